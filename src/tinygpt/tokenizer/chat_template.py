"""Chat templates: how a conversation becomes text and tokens. tinygpt's own (ChatTemplate: a role's
start token, the content, the end of turn) and a pretrained model's Jinja one (JinjaChatTemplate, rendered
with jinja2 as transformers' apply_chat_template renders it).
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ChatError, TokenizerError

if TYPE_CHECKING:  # for annotations only: hf imports this module
    from .hf import HFTokenizer

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Rendered:
    """A conversation as token ids, and its loss mask: 1 where a model learns to write the token
    (the assistant's content and end of turn), 0 elsewhere."""

    ids: list[int]
    mask: list[int]


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation becomes tokens: each message is its role's start token, the content's
    ids, and the end-of-turn token; a prompt for a reply ends with the assistant's start token.

        <|system|>You answer briefly.<|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>

    Args:
        start: the spelling of a role's start token, with "{role}" where the role's name goes.
        end: the spelling of the end-of-turn token (the one generation stops at).
        roles: the roles a message may have.
    """

    start: str = "<|{role}|>"
    end: str = "<|end|>"
    roles: tuple[str, ...] = ROLES

    def __post_init__(self) -> None:
        if not isinstance(self.start, str) or self.start.count("{role}") != 1:
            raise ChatError(f'a chat template\'s start must hold "{{role}}" once, got {self.start!r}')
        if not isinstance(self.end, str) or not self.end:
            raise ChatError("a chat template's end-of-turn token must be a non-empty string")
        roles = tuple(self.roles)
        distinct = all(isinstance(r, str) and r for r in roles) and len(set(roles)) == len(roles)
        if "assistant" not in roles or not distinct:
            raise ChatError(f"a chat template's roles must be distinct names including assistant, got {roles!r}")
        object.__setattr__(self, "roles", roles)
        if len(set(self.special_tokens())) != len(roles) + 1:
            raise ChatError("a chat template's special tokens must all differ")

    def start_token(self, role: str) -> str:
        """The spelling of `role`'s start token."""
        return self.start.replace("{role}", role)

    def special_tokens(self) -> list[str]:
        """Every special token the template uses, in id order: the roles' starts, then the end of turn."""
        return [self.start_token(r) for r in self.roles] + [self.end]

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "roles": list(self.roles)}

    @classmethod
    def from_dict(cls, data: Any) -> ChatTemplate:
        """The template from its `to_dict()` form.

        Raises:
            ChatError: not a template's form.
        """
        if not isinstance(data, dict) or not isinstance(data.get("roles", []), list):
            raise ChatError('a chat template is an object with "start", "end" and "roles"')
        return cls(data.get("start", cls.start), data.get("end", cls.end), tuple(data.get("roles", ROLES)))

    def jinja(self) -> str:
        """The template in Jinja, as transformers' `apply_chat_template` runs it (tokenizer_config.json's
        `chat_template`): messages with another role raise, `add_generation_prompt` appends the
        assistant's start. The special tokens it writes are split out by the tokenizer before the
        contents are encoded, so the ids equal `render_chat`'s."""
        before, after = self.start.split("{role}")
        roles = "[" + ", ".join(map(_jinja_str, self.roles)) + "]"
        return (
            "{% for message in messages %}"
            f"{{% if message['role'] not in {roles} %}}"
            "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
            f"{{{{ {_jinja_str(before)} + message['role'] + {_jinja_str(after)} + message['content'] + "
            f"{_jinja_str(self.end)} }}}}"
            "{% endfor %}"
            f"{{% if add_generation_prompt %}}{{{{ {_jinja_str(self.start_token('assistant'))} }}}}{{% endif %}}"
        )


class JinjaChatTemplate:
    """A Hugging Face model's chat template: Jinja, rendered with jinja2 as transformers' apply_chat_template
    renders it (a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, the
    {% generation %} tag, raise_exception, strftime_now and a tojson that keeps non-ASCII text; the
    special tokens as bos_token, eos_token, ...), the text then encoded with its special tokens found.

    The loss mask of a conversation (render_chat) covers the assistant's replies: the text inside
    {% generation %} blocks where the template marks them, otherwise each reply found by rendering
    the conversation up to it (with the generation prompt) and through it, whatever the template
    writes between (the end of turn included).

    Args:
        source: the template.
        tokens: the special tokens it may name (HFTokenizer.template_tokens()).
    """

    roles = ROLES

    def __init__(self, source: str, tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatError("a Jinja chat template must be non-empty text")
        self.source = source
        self.tokens = dict(tokens or {})
        _compiled_template(source)  # a template that does not compile is refused here, once

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JinjaChatTemplate) and (self.source, self.tokens) == (other.source, other.tokens)

    __hash__ = None

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's replies with {% generation %}."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> tuple[str, list]:
        """The conversation's text, and the (start, end) characters of its {% generation %} blocks; `tools`
        as apply_chat_template passes them (OpenAI's function objects).

        Raises:
            ChatError: the template raises (raise_exception, an undefined name, a sandbox refusal).
        """
        import jinja2

        template = _compiled_template(self.source)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _GENERATION.set((blocks, spans))
        try:
            for chunk in template.generate(messages=[dict(m) for m in messages], tools=tools, documents=None,
                                           add_generation_prompt=add_generation_prompt, **self.tokens):
                blocks.append(chunk)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template raised: {e}") from None
        except Exception as e:  # anything a template's expressions can raise (a type error in it, say)
            raise ChatError(f"the chat template raised {type(e).__name__}: {e}") from None
        finally:
            _GENERATION.reset(token)
        return "".join(blocks), spans

    def rendered(self, tokenizer: HFTokenizer, messages: list[dict[str, str]]) -> Rendered:
        """The conversation's ids as apply_chat_template gives them, and its loss mask (see the class)."""
        text, spans = self.render(messages)
        if not self.marks_generation:
            spans = self._replies(messages, text)
        ids, offsets = tokenizer.encode_rendered(text)
        mask, at = [], 0
        for start, end in offsets:  # a token learns where it overlaps a reply (offsets and spans in order)
            while at < len(spans) and start >= spans[at][1]:
                at += 1
            mask.append(int(at < len(spans) and end > spans[at][0] and end > start))
        return Rendered(ids, mask)

    def _replies(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Each assistant reply's span in `text`, from the renderings up to it and through it."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, _ = self.render(messages[:i], add_generation_prompt=True)
            through, _ = self.render(messages[: i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatError(f"the chat template does not write message {i + 1} (assistant) after the ones before "
                                "it as it writes the whole conversation, so its reply cannot be found; mark replies "
                                "with {% generation %} ... {% endgeneration %}")
            spans.append((len(before), len(through)))
        return spans

    def prompt_ids(self, tokenizer: HFTokenizer, messages: list[dict[str, Any]],
                   tools: list[dict] | None = None) -> list[int]:
        """The ids a model continues to write the assistant's next turn (add_generation_prompt), with `tools`."""
        return tokenizer.encode_rendered(self.render(messages, add_generation_prompt=True, tools=tools)[0])[0]

    def turn_ends(self, tokenizer: HFTokenizer) -> list[str]:
        """The special token the template writes right after a reply (its end of turn), as a list of
        none or one: found by rendering a reply and reading the first special token after it."""
        reply = "tinygpt-reply"
        try:
            text, _ = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}])
        except ChatError:
            return []
        rest = text[text.rfind(reply) + len(reply):] if reply in text else ""
        found = [(rest.find(t), t) for t in tokenizer.special_ids() if t and t in rest]
        return [min(found)[1]] if found else []

    def special_tokens(self) -> list[str]:
        return list(self.tokens.values())

    def jinja(self) -> str:
        return self.source

    def to_dict(self) -> dict[str, Any]:
        return {"jinja": self.source}


# the {% generation %} blocks of the template being rendered: (the chunks written so far, their spans)
_GENERATION: contextvars.ContextVar = contextvars.ContextVar("tinygpt_generation_spans", default=None)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> Any:
    """A chat template compiled as transformers compiles one (see JinjaChatTemplate)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise TokenizerError("jinja2 is not installed: pip install jinja2") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %} ... {% endgeneration %}: where its text lands in the rendering."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracked = _GENERATION.get()
            if tracked is not None:
                start = sum(map(len, tracked[0]))
                tracked[1].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template is not valid Jinja ({e})") from None


def _jinja_str(text: str) -> str:
    """A Jinja string literal of `text` (its escapes are Python's)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
