"""The one base class of the project's user errors: a mistake the user can fix, raised with a message that is one
line naming the fix. It lives at the bottom layer so the models (which import nothing from trainer/) raise it too;
train.py, the CLIs and `describe_user_error` catch it by type."""

from __future__ import annotations


class UserError(ValueError):
    """A bad configuration, input or request; the message is one line that names the fix."""
