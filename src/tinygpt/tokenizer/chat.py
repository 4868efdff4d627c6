"""Chats with a tokenizer's template: a tokenizer given one (its special tokens added), a conversation
checked, rendered to ids and loss mask for training or to a prompt for a reply, fitted to a context, and
the ids that end a reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ChatError
from .base import Tokenizer
from .chat_template import ROLES, ChatTemplate, JinjaChatTemplate, Rendered
from .hf import HFTokenizer


def with_chat_template(tokenizer: Tokenizer, template: ChatTemplate | JinjaChatTemplate | None = None) -> Tokenizer:
    """A copy of `tokenizer` that carries a chat template, its special tokens added where missing.

    Char vocabularies get them as ids after the characters, BPE as added special tokens, GPT-2 as
    ids after 50,256 (a model trained before needs its embedding grown: `tinygpt.model.grow_vocab`).
    The tokenizer given is not changed. A Jinja template goes with a pretrained model's own
    tokenizer (HFTokenizer), whose special tokens it names.

    Args:
        tokenizer: any tinygpt tokenizer.
        template: the template (ChatTemplate(): <|system|>, <|user|>, <|assistant|>, <|end|>).
    """
    if isinstance(template, JinjaChatTemplate):
        if not isinstance(tokenizer, HFTokenizer):
            raise ChatError(f"a Jinja chat template goes with a Hugging Face model's tokenizer, not a {tokenizer.kind} "
                            "one")
        return HFTokenizer(tokenizer._data, tokenizer.config, template.source)
    template = template or ChatTemplate()
    tok = tokenizer._with_specials(template.special_tokens())
    tok.chat_template = template
    return tok


def check_messages(messages: Any, roles: Sequence[str] = ROLES, *, training: bool = True) -> None:
    """Refuse a conversation that is not a list of {"role", "content"} messages with known roles and
    text content.

    Args:
        messages: the conversation.
        roles: the roles allowed (the template's).
        training: the conversation is training data: it needs an assistant turn (something to learn),
            and no turn may be empty. A prompt may hold an empty assistant turn (a reply the model
            ended at once, or one stopped before its first word) but no empty system or user turn.

    Raises:
        ChatError: what is wrong, naming the message (1-based).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatError('"messages" must be a non-empty list')
    for n, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise ChatError(f"message {n} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in roles:
            raise ChatError(f"message {n} has an unknown role {role!r} (expected {', '.join(roles)})")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue  # a turn of tool calls alone
        if not isinstance(content, str):
            raise ChatError(f"message {n} ({role}) has no text content")
        if not content.strip() and (training or role not in ("assistant", "tool")):
            raise ChatError(f"message {n} ({role}) has empty content")
    if training and not any(m["role"] == "assistant" for m in messages):
        raise ChatError("the conversation has no assistant turn")


def chat_template_of(tokenizer: Tokenizer) -> ChatTemplate | JinjaChatTemplate:
    """The tokenizer's chat template.

    Raises:
        ChatError: it has none.
    """
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ChatError("the tokenizer has no chat template (prepare the data with --format chat)")
    return template


def stop_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a generation: the document separator (eot_id) where the kind has one, and,
    where the tokenizer carries a chat template, its end of turn and every role's start (a chat run's
    reply, or its sample, ends there: a role's start begins another turn, and its spelling is no text
    the conversation could carry on with). What the server's chat, `tinygpt chat` and `tinygpt sample`
    pass as stop_tokens."""
    if isinstance(tokenizer, HFTokenizer):  # generation_config.json's eos ids, the eos token, the end of turn
        return frozenset(tokenizer.stop_token_ids)
    ids = set() if tokenizer.eot_id is None else {tokenizer.eot_id}
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        special = tokenizer.special_ids()
        ids.update(special[token] for token in template.special_tokens())
    return frozenset(ids)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Rendered:
    """A whole conversation as ids and loss mask, with the tokenizer's chat template.

    Args:
        tokenizer: a tokenizer with a chat template (with_chat_template).
        messages: [{"role": "system" | "user" | "assistant", "content": "..."}, ...], with an
            assistant turn.

    Raises:
        ChatError: a malformed conversation or a tokenizer without a template.
        TokenizerError: content the vocabulary cannot encode.
    """
    template = chat_template_of(tokenizer)
    check_messages(messages, template.roles)
    if isinstance(template, JinjaChatTemplate):
        return template.rendered(tokenizer, messages)
    ids, mask = _render(tokenizer, template, messages)
    return Rendered(ids, mask)


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None
                       ) -> list[int]:
    """The ids a model continues to write the assistant's next turn: the messages, then the assistant's start.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: the conversation; with a Jinja template also tool results (role "tool") and assistant
            turns of tool calls (`tool_calls`, their arguments objects), as transformers passes them.
        tools: OpenAI's function tools: a Jinja template is given them; for tinygpt's own, which has no
            tools, they and the calls and results are written into the messages (toolcalls.text_messages).

    Raises:
        ChatError, TokenizerError: as render_chat (no assistant turn is needed).
    """
    template = chat_template_of(tokenizer)
    if isinstance(template, JinjaChatTemplate):
        check_messages(messages, (*template.roles, "tool"), training=False)
        return template.prompt_ids(tokenizer, messages, tools)
    if tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages if isinstance(m, dict)):
        from ..toolcalls import text_messages  # here: toolcalls reads a vocabulary (constrain), which imports this

        messages = text_messages(messages, tools)
    check_messages(messages, template.roles, training=False)
    ids, _ = _render(tokenizer, template, messages)
    return ids + [tokenizer.special_ids()[template.start_token("assistant")]]


def fit_chat_prompt(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], max_tokens: int, tools: list[dict] | None = None
) -> tuple[list[dict[str, Any]], list[int], int]:
    """The conversation trimmed oldest-first until its prompt (render_chat_prompt) holds at most
    `max_tokens` ids, a whole exchange at a time: the oldest message and what follows it up to the next
    user message go together, so what is kept starts with a user's turn, as templates that require the
    roles to alternate (Llama 2's, Mistral's, Gemma's) demand. A leading system message stays, and so
    does the last exchange, even alone over the limit (generation then sees the prompt's last tokens only).

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: the conversation so far, ending with the message to answer.
        max_tokens: the prompt's budget (the model's context less room for the reply).
        tools: the tools the template is given (render_chat_prompt).

    Returns:
        (the messages kept, their prompt's ids, how many messages were dropped).
    """
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(system):]
    dropped = 0
    while True:
        ids = render_chat_prompt(tokenizer, system + rest, tools)
        following = next((i for i in range(1, len(rest)) if rest[i].get("role") == "user"), None)
        if len(ids) <= max_tokens or following is None:
            return system + rest, ids, dropped
        rest, dropped = rest[following:], dropped + following


def _render(
    tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    special = tokenizer.special_ids()
    end = special[template.end]
    contents = tokenizer.encode_batch([m["content"] for m in messages])  # text only: never a special token
    ids: list[int] = []
    mask: list[int] = []
    for m, content in zip(messages, contents):
        learn = int(m["role"] == "assistant")
        ids += [special[template.start_token(m["role"])], *content, end]
        mask += [0] + [learn] * (len(content) + 1)
    return ids, mask
