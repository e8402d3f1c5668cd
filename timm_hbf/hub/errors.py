"""Errors of pushes to the Hub that say what happened and what to do."""
from contextlib import contextmanager
from typing import Iterator, Optional

from huggingface_hub import constants, get_session, get_token
from huggingface_hub.errors import HfHubHTTPError

__all__ = ['HubError', 'hub_errors']


class HubError(RuntimeError):
    """A push to the Hugging Face Hub failed, or what it would push cannot be read or written; the message says what
    to do."""


@contextmanager
def hub_errors(repo_id: str, revision: Optional[str] = None) -> Iterator[None]:
    """Raise the errors of the Hub client inside the block, its own and those of its connections (or the first cause
    that is one: the client wraps some in a RuntimeError), as one :class:`HubError` line naming the fix."""
    try:
        yield
    except Exception as err:
        cause, http_library = err, type(get_session()).__module__.split('.')[0]  # httpx, or requests before 1.0
        while cause is not None and not isinstance(cause, OSError) and \
                type(cause).__module__.split('.')[0] != http_library:
            cause = cause.__cause__
        if cause is None:
            raise
        raise HubError(f'Pushing to {repo_id}@{revision or "main"} failed: {_explain(cause, repo_id)}') from err


def _explain(err: BaseException, repo_id: str) -> str:
    status = err.response.status_code if isinstance(err, HfHubHTTPError) and err.response is not None else None
    if status is None:  # no answer: the connection could not be opened, or it broke off
        return (f'no answer from {constants.ENDPOINT} ({type(err).__name__}: {err}). Check the network connection, '
                'the proxy settings and HF_ENDPOINT, and run again.')
    if status == 401:
        who = 'you are not logged in' if get_token() is None else 'the Hub refused your token'
        return f'{who} (HTTP 401): log in with `hf auth login` or set HF_TOKEN to a token with write access.'
    if status == 403:
        return f'your token may not do this (HTTP 403). Use a token with write access to {repo_id.split("/")[0]}.'
    if status >= 500:
        return f'{constants.ENDPOINT} answered HTTP {status}, an error on the server side. Try again later.'
    return f'{constants.ENDPOINT} answered HTTP {status}: {str(err).splitlines()[0]}'
