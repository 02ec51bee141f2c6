"""Chat messages → the prompt text: the tokenizer's own chat template when it has one (a model
imported from Hugging Face keeps it in tokenizer_config.json), else ultratron's plain template.

Templates are Jinja, rendered as Hugging Face transformers renders them: a sandboxed
environment with trim_blocks and lstrip_blocks, the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and a `raise_exception` function, so the
templates published with models work unchanged.
"""

from __future__ import annotations

from functools import lru_cache

ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool", "developer": "System"}
CHAT_STOP = "\n###"  # the plain template's next turn


class TemplateError(ValueError):
    """The model's chat template rejected the conversation (its own raise_exception, or a bug)."""


def plain_prompt(messages: list[dict]) -> str:
    """The plain template: one '### Role' block per message, then the assistant's turn. The
    tokenizers ultratron trains are plain byte-level BPE, so the template is plain text too."""
    parts = [f"### {ROLES.get(m['role'], m['role'].title())}\n{m['content']}\n\n" for m in messages]
    return "".join(parts) + "### Assistant\n"


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def chat_prompt(messages: list[dict], tokenizer=None) -> str:
    """The prompt for `messages` under the tokenizer's chat template (or the plain one, also
    without a tokenizer)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return plain_prompt(messages)
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=True,
                                          bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token)
    except TemplateError:
        raise
    except Exception as err:  # jinja2 raises TemplateSyntaxError, UndefinedError, SecurityError, ...
        raise TemplateError(f"the model's chat template failed: {type(err).__name__}: {err}") from None


def chat_stops(tokenizer) -> tuple[str, ...]:
    """Stop strings a chat completion adds: the plain template's next turn; a model's own template
    ends the turn with its end-of-text token, which stops generation anyway."""
    return () if getattr(tokenizer, "chat_template", None) else (CHAT_STOP,)
