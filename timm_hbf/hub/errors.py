"""The error of the Hub tools: its message says what went wrong and what to do."""

__all__ = ['HubError']


class HubError(RuntimeError):
    """A push to the Hugging Face Hub failed, or what it would push cannot be read or written; the message says what
    to do."""
