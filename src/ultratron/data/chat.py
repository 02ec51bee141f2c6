"""Chat messages → text and tokens: the one chat template that training and serving share.

A conversation is rendered with the tokenizer's own chat template when it has one (a model
imported from Hugging Face keeps it in tokenizer_config.json), else with ultratron's plain
template, `DEFAULT_CHAT_TEMPLATE`:

    ### System
    {content}

    ### User
    {content}

    ### Assistant
    {content}<|endoftext|>

(an assistant turn ends with the tokenizer's end-of-text token, so a model trained on it stops
there). Templates are Jinja, rendered as Hugging Face transformers renders them: a sandboxed
environment with trim_blocks and lstrip_blocks, the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and a `raise_exception` function, so the
templates published with models work unchanged.

For training, `render_conversation` tokenizes a conversation piece by piece: for each assistant
turn, the text up to the turn's generation prompt is what a server would send the model as the
prompt, and the rest of that turn's text (the answer and whatever the template closes it with) is
what the model should produce; only those tokens count in the loss. Encoding the pieces one by
one gives exactly the tokens the server's prompt has, so training and serving see the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT_STOP = "\n###"  # the plain template's next turn
DEFAULT_EOS = "<|endoftext|>"  # ultratron's own tokenizers' end-of-text token (data/tokenizer.py)

# Newlines are written as expressions: trim_blocks would swallow a newline after a block tag.
DEFAULT_CHAT_TEMPLATE = (
    "{% set names = {'system': 'System', 'user': 'User', 'assistant': 'Assistant', 'tool': 'Tool', "
    "'developer': 'System'} %}"
    "{% for message in messages %}"
    "{{ '### ' + names.get(message['role'], message['role'] | title) + '\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant\\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The model's chat template rejected the conversation (its own raise_exception, or a bug)."""


class ContentError(ValueError):
    """A message's content is neither a string nor a list of text parts."""


def content_text(content) -> str:
    """A message's content as text: a string, or a list of parts `{"type": "text", "text": ...}`
    (as the OpenAI API and most clients send), joined. Other part types raise ContentError naming
    them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ContentError(f"content must be a string or a list of text parts, not {type(content).__name__}")
    texts, others = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            others.append(str(kind))
    if others:
        raise ContentError(f"only text content parts are supported; got part type(s) {', '.join(sorted(set(others)))}")
    return "".join(texts)


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def chat_template_of(tokenizer) -> str:
    """The template a tokenizer's conversations are rendered with (its own, or the default)."""
    return getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render(messages: list[dict], tokenizer=None, add_generation_prompt: bool = True) -> str:
    """`messages` as text under the tokenizer's chat template (or the default one, also without a
    tokenizer). Contents may be strings or lists of text parts."""
    messages = [{**m, "content": content_text(m.get("content"))} for m in messages]
    eos = getattr(tokenizer, "eos_token", None) or DEFAULT_EOS
    try:
        return _compiled(chat_template_of(tokenizer)).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=getattr(tokenizer, "bos_token", None) or "", eos_token=eos)
    except TemplateError:
        raise
    except Exception as err:  # jinja2 raises TemplateSyntaxError, UndefinedError, SecurityError, ...
        raise TemplateError(f"the model's chat template failed: {type(err).__name__}: {err}") from None


def chat_prompt(messages: list[dict], tokenizer=None) -> str:
    """The prompt for `messages`: the conversation and the assistant's generation prompt."""
    return render(messages, tokenizer, add_generation_prompt=True)


def chat_stops(tokenizer) -> tuple[str, ...]:
    """Stop strings a chat completion adds: the default template's next turn (for models never
    trained to end their turn; also when an export wrote the default template out and it came
    back with an import); a model's own template ends the turn with its end-of-text token, which
    stops generation anyway."""
    return (CHAT_STOP,) if chat_template_of(tokenizer) == DEFAULT_CHAT_TEMPLATE else ()


# ---- training: a conversation → tokens and the loss mask -------------------------------------


@dataclass(frozen=True)
class Rendered:
    """A conversation's token ids and, per token, whether the model is trained to produce it."""

    ids: list[int]
    mask: list[bool]

    @property
    def n_loss_tokens(self) -> int:
        return sum(self.mask)


class Reject(ValueError):
    """A conversation that cannot be trained on; `reason` is a short key for the reject counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def check_messages(record) -> list[dict]:
    """The messages of one JSONL record, or Reject saying what is wrong with them."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise Reject("no_messages", 'expected an object with a non-empty "messages" list')
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role is None:
            raise Reject("missing_role", f"message {i} has no role")
        if role not in ROLES:
            raise Reject("unknown_role", f"message {i} has role {role!r}, not one of {', '.join(ROLES)}")
        try:
            out.append({**message, "content": content_text(message.get("content"))})
        except ContentError as err:
            raise Reject("bad_content", f"message {i}: {err}") from None
    if not any(m["role"] == "assistant" for m in out):
        raise Reject("no_assistant_turn", "the conversation has no assistant turn to learn from")
    return out


INSTRUCTION_ROLES = ("system", "developer")


def conversation_text(messages: list[dict]) -> str:
    """What curation measures of a checked conversation (dedup, length and quality filters): the
    contents of its turns, blank-line separated, without the template's markup (a role header in
    every turn would read as repeated lines to the filters) and without system or developer
    prompts (one prompt shared by many conversations would make them near duplicates)."""
    return "\n\n".join(m["content"] for m in messages if m["role"] not in INSTRUCTION_ROLES)


def render_conversation(messages: list[dict], tokenizer) -> Rendered:
    """Token ids of a conversation with the loss mask on its assistant turns (see the module
    docstring). Reject when the template does not render the conversation as a sequence of
    growing prefixes (a template that rewrites earlier turns cannot be masked this way)."""
    ids: list[int] = []
    mask: list[bool] = []
    done = ""  # the text rendered so far

    def take(text: str, counts: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise Reject("template_not_incremental",
                         "the chat template renders a conversation's beginning differently once later turns follow")
        piece = tokenizer.encode(text[len(done):]) if len(text) > len(done) else []
        ids.extend(piece)
        mask.extend([counts] * len(piece))
        done = text

    try:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            take(render(messages[:i], tokenizer, add_generation_prompt=True), False)
            take(render(messages[:i + 1], tokenizer, add_generation_prompt=False), True)
        take(render(messages, tokenizer, add_generation_prompt=False), False)  # turns after the last answer
    except TemplateError as err:
        raise Reject("template_error", str(err)) from None
    if not any(mask):
        raise Reject("empty_answers", "the assistant turns render to no tokens")
    return Rendered(ids, mask)
