"""Errors of Hub transfers that say what happened and what to do."""
import socket
from contextlib import contextmanager
from typing import Iterator, Optional

from huggingface_hub import constants, get_session, get_token
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

__all__ = ['HubError', 'hub_errors']

LOGIN = 'log in with `hf auth login` or set HF_TOKEN'
# The errors of a connection that could not be opened, by class name: those of httpx (huggingface_hub >= 1) and of
# urllib3, which requests (older huggingface_hub) raises its ConnectionError from
CONNECT_ERRORS = ('ConnectError', 'ConnectTimeout', 'ConnectTimeoutError', 'NewConnectionError', 'NameResolutionError')


class HubError(RuntimeError):
    """A push to or a pull from the Hugging Face Hub failed; the message says what to do."""


@contextmanager
def hub_errors(action: str, repo_id: str, revision: Optional[str] = None) -> Iterator[None]:
    """Raise the errors of the Hub client inside the block as :class:`HubError` naming the fix, the original chained:
    its own errors, those of the HTTP library it uses (a dropped connection, a timeout) and OS errors (a download cut
    short, a full disk). Other exceptions pass unchanged.

    Args:
        action: What the block does, for the message (``'Downloading config.json from'``).
        repo_id: The repo the block talks to.
        revision: The revision it asks for (None for the default branch).
    """
    try:
        yield
    except Exception as err:
        cause = _hub_cause(err)
        if cause is None:
            raise
        raise HubError(f'{action} {repo_id}@{revision or "main"} failed: {_explain(cause, repo_id, revision)}') from err


def _hub_cause(err: BaseException) -> Optional[BaseException]:
    """``err`` or the first of its causes that the Hub client or its HTTP library raised (the client wraps some in a
    RuntimeError), None if there is none."""
    http_library = type(get_session()).__module__.split('.')[0]
    while err is not None:
        # huggingface_hub's own errors are OS errors, entry-not-found errors or validation errors
        if isinstance(err, (OSError, EntryNotFoundError, HFValidationError)):
            return err
        if type(err).__module__.split('.')[0] == http_library:
            return err
        err = err.__cause__
    return None


def _explain(err: BaseException, repo_id: str, revision: Optional[str]) -> str:
    endpoint = constants.ENDPOINT
    if isinstance(err, HFValidationError):
        return f'{repo_id!r} is not a repo id; use ORG/NAME. ({err})'
    if isinstance(err, GatedRepoError):
        return (f'the repo is gated. Request access on {endpoint}/{repo_id}, then {LOGIN} as the account that was '
                'granted it.')
    if isinstance(err, RepositoryNotFoundError):
        if get_token() is None:
            return (f'{endpoint} has no repo {repo_id}, or it is private and you are not logged in. Check the repo id; '
                    f'for a private repo, {LOGIN}.')
        return f'{endpoint} has no repo {repo_id}, or your token may not read it. Check the repo id and the token.'
    if isinstance(err, RevisionNotFoundError):
        return f'the repo has no branch, tag or commit {revision!r}. Check the revision after the "@".'
    if isinstance(err, (OfflineModeIsEnabled, LocalEntryNotFoundError)) and constants.HF_HUB_OFFLINE:
        return (f'HF_HUB_OFFLINE=1 is set and the file is not in the cache ({constants.HF_HUB_CACHE}). Download it '
                'once with HF_HUB_OFFLINE unset.')
    if isinstance(err, LocalEntryNotFoundError):
        if isinstance(err.__cause__, HfHubHTTPError):
            return _explain(err.__cause__, repo_id, revision)
        return (f'cannot reach {endpoint} ({err.__cause__ or err}). Check the network connection, the proxy settings '
                'and HF_ENDPOINT; files already in the cache load offline with HF_HUB_OFFLINE=1.')
    if isinstance(err, EntryNotFoundError):
        return f'the file is not in the repo at this revision. ({err})'
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        if status == 401 and get_token() is None:
            return f'you are not logged in (HTTP 401): {LOGIN} to a token with write access.'
        if status == 401:
            return f'the Hub refused your token (HTTP 401): {LOGIN} to a valid one.'
        if status == 403:
            return (f'your token may not do this (HTTP 403). Use a token with write access to '
                    f'{repo_id.split("/")[0]}.')
        if status is not None and status >= 500:
            return f'{endpoint} answered HTTP {status}, an error on the server side. Try again later.'
        return f'{endpoint} answered HTTP {status}: {err}'
    if _not_connected(err):
        return (f'cannot reach {endpoint} ({err}). Check the network connection, the proxy settings and '
                'HF_ENDPOINT.')
    # The rest comes from the transfer itself: a connection dropped for good, a body cut short, a disk error.
    # The client keeps no partial file, so running again starts clean.
    return f'the transfer broke off ({type(err).__name__}: {err}). Check the network connection and run again.'


def _not_connected(err: BaseException) -> bool:
    """Whether ``err`` is or comes from a failure to open a connection (the host name did not resolve, the connection
    was refused or timed out), before anything was sent: not a connection that broke off."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionRefusedError, socket.gaierror)) or type(err).__name__ in CONNECT_ERRORS:
            return True
        err = err.__cause__ or err.__context__
    return False
