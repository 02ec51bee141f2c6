"""The chat template of the server: the one `ultratron.data.chat` defines for training too."""

from ultratron.data.chat import (  # noqa: F401  (re-exported: serving's name for them)
    CHAT_STOP,
    DEFAULT_CHAT_TEMPLATE,
    ContentError,
    TemplateError,
    chat_prompt,
    chat_stops,
    chat_template_of,
    content_text,
)
