"""`tinygpt chat`: talk with a run trained on conversations, in the terminal or for one scripted turn."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

from ..calc.units import plural
from ..errors import ConfigError
from .common import (NATURAL, POSITIVE, Number, add_device_flag, add_quantize_flag, add_speculation_flags,
                     encodable_flag, json_line, load_model, load_speculation, seed_type, utf8_flag)

# C0 controls but newline and tab, DEL and C1, shown as escapes: a reply written raw could move the
# cursor, clear the screen or send the terminal commands (ESC sequences, 8-bit CSI)
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160)) if c not in (9, 10)}

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system message), /stats (what "
        "speculative decoding did), /help; //TEXT sends /TEXT as a message; Ctrl-D quits")


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a run trained on conversations (`prepare --format chat`, then `train`): messages are
    written with the run's own chat template and each reply streams until its end-of-turn token.

    Interactively: type a message and press Enter. Ctrl-C stops a reply (what was written stays in
    the conversation) without leaving; Ctrl-D quits. /reset forgets the conversation, /system TEXT
    sets the system message; a message that starts with / is typed with two (//etc sends /etc).
    The conversation is kept within the model's context: when it grows past it, the oldest exchanges
    (a user's message and the reply to it) are dropped whole, so the kept part starts with a user's
    turn as templates that require alternating roles demand (the system message stays), and a note
    says so; a message longer than the context alone is answered from its end, with a note.

    With --prompt TEXT: answer that one message, print the reply and exit (at --temperature 0 the
    same reply `tinygpt serve` gives).

    With --tools FILE (a JSON list of OpenAI function tools): the template is given them (a Hugging Face
    model's own, as transformers passes them; tinygpt's lists them in the system message), and where a
    reply calls one, the call is shown and its result asked for, which the model then reads.

    Each reply reuses the keys and values of the conversation so far (a prompt cache): only the new
    message is computed, unless the template writes earlier turns another way the next time.

    With --draft RUN or --prompt-lookup N, replies decode speculatively (the same replies, faster where
    the proposals stand); /stats says how many stood in the last reply and in the conversation.
    """
    from ..config.sampling import SampleConfig

    SampleConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # checked before loading
    utf8_flag(args.prompt, "--prompt")
    utf8_flag(args.system, "--system")
    model, tokenizer = load_model(args.run, args.device, args.quantize)
    if tokenizer.chat_template is None:
        raise ConfigError(f"{args.run} has no chat template: train a run on chat data "
                          "(tinygpt prepare FILE.jsonl --format chat) to chat with it; use `tinygpt sample` here")
    args.system = _system_message(tokenizer, args.system, "--system")
    tools = _read_tools(args.tools) if args.tools else None
    session = _Session(model, tokenizer, args, tools, load_speculation(args, model, tokenizer))
    if args.prompt is not None:
        session.reply(args.prompt, sys.stdout)
        for call in session.pending_calls():  # one turn: the calls are shown, not answered
            print(f"(calls {call['function']['name']}({json_line(call['function']['arguments'])}))", file=sys.stderr)
        return 0
    return _interactive(session)


class _Session:
    """One conversation: its messages, the model, the sampling settings."""

    def __init__(self, model, tokenizer, args: argparse.Namespace, tools: list[dict] | None = None,
                 speculation: dict | None = None) -> None:
        import torch

        from ..kv_cache import KVCache
        from ..prompt_cache import PromptCache
        from ..speculative import SpeculationStats
        from ..tokenizer.chat import stop_ids
        from ..tokenizer.chat_template import JinjaChatTemplate
        from ..toolcalls import TEXT_FORMAT, call_format

        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.system = args.system
        self.history: list[dict[str, str]] = []
        self.max_new_tokens = args.max_new_tokens
        self.sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        self.speculation = speculation or {}
        self.last, self.total = None, SpeculationStats()  # the last reply's speculation, and the conversation's
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed) if args.seed is not None else None
        self.stops = stop_ids(tokenizer)
        block = model.config.block_size
        # the prompt leaves room for the reply: its max length, but at most half the context
        self.budget = block - min(self.max_new_tokens, block // 2)
        # the conversation's keys and values, twice over: the turn just taken and the one before
        self.cache = PromptCache(2 * KVCache.bytes_for_model(model, 1))
        self.tools, self.fmt = tools, None
        template = tokenizer.chat_template
        if tools and not isinstance(template, JinjaChatTemplate):
            self.fmt = TEXT_FORMAT  # tinygpt's template has no tools: they are written as text
        elif tools:
            ends = template.turn_ends(tokenizer)
            self.fmt = call_format(template, ends[0] if ends else None)
            if self.fmt is None:
                raise ConfigError("--tools: this model's chat template writes no tool calls")

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def reply(self, text: str, out: TextIO, label: str = "") -> None:
        """Answer `text`, streaming the reply to `out` after `label`, once the notes on what the prompt
        keeps are printed (on lines of their own); Ctrl-C stops it and keeps what was written."""
        self.history.append({"role": "user", "content": text})
        self.answer(out, label)

    def answer(self, out: TextIO, label: str = "") -> None:
        """Write the assistant's next turn after the conversation so far (reply's second half)."""
        import torch

        from ..generate import generate_stream
        from ..tokenizer.chat import fit_chat_prompt
        from ..tokenizer.incremental import IncrementalDecoder

        kept, ids, dropped = fit_chat_prompt(self.tokenizer, self.messages(), self.budget, self.tools)
        if dropped:
            exchanges = sum(m["role"] == "user" for m in self.history[:dropped])
            self.history = kept[1:] if self.system else kept
            print(f"(dropped the {plural(exchanges, 'oldest exchange')} ({plural(dropped, 'message')}; a message "
                  f"goes with its reply) to stay within the model's context of {self.model.config.block_size} tokens)",
                  file=sys.stderr)
        block, first = self.model.config.block_size, ", the system message first" if self.system else ""
        # the last message alone is too long: generation's window holds the last `block` tokens
        if len(ids) > block:
            print(f"(the prompt is {len(ids):,} tokens, more than the model's context of {block:,}: the reply "
                  f"cannot see its first {len(ids) - block:,}{first}, and sees less as it grows)", file=sys.stderr)
        elif len(ids) > self.budget:
            print(f"(the prompt is {len(ids):,} tokens of the model's context of {block:,}: the reply's first "
                  f"{block - len(ids) + 1:,} tokens see all of it, later ones lose sight of its start{first})",
                  file=sys.stderr)
        out.write(label)
        decoder, answer, seen = IncrementalDecoder(self.tokenizer), [], []
        observer = (lambda step: seen.append(step.speculation) if not seen else None) if self.speculation else None
        try:
            for token in generate_stream(self.model, torch.tensor([ids], device=self.device), self.max_new_tokens,
                                         stop_tokens=self.stops, generator=self.generator, prompt_cache=self.cache,
                                         observer=observer, vocab_size=self.tokenizer.vocab_size, **self.sampling,
                                         **self.speculation):
                if int(token[0]) in self.stops:
                    break
                piece = decoder.push([int(token[0])])
                answer.append(piece)
                out.write(piece.translate(_CONTROLS))
                out.flush()
        except KeyboardInterrupt:
            out.write(" [stopped]")
        answer.append(decoder.flush())
        out.write(answer[-1].translate(_CONTROLS) + "\n")
        out.flush()
        self.history.append(self._turn("".join(answer)))
        if seen:  # the reply's figures (one object, counted to its end)
            self.last = seen[0]
            self.total.add(self.last)

    def stats(self) -> str:
        """/stats: what speculative decoding did in the last reply and in the whole conversation."""
        if not self.speculation:
            return "speculative decoding is off (--draft RUN or --prompt-lookup N turns it on)"
        if self.last is None:
            return "no reply yet"
        return f"last reply: {self.last.describe()}; this conversation: {self.total.describe()}"

    def _turn(self, text: str) -> dict:
        """The assistant's message: its text, and the tools it calls (an OpenAI message, arguments objects)."""
        import json

        from ..toolcalls import read_calls

        if self.fmt is None:
            return {"role": "assistant", "content": text}
        content, calls = read_calls(text, self.fmt, [t["function"]["name"] for t in self.tools])
        made = []
        for call in calls:
            try:
                made.append({"id": call["id"], "type": "function",
                             "function": {"name": call["name"], "arguments": json.loads(call["arguments"])}})
            except ValueError:  # cut off before its end: the text stays, as the model wrote it
                return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content, **({"tool_calls": made} if made else {})}

    def pending_calls(self) -> list[dict]:
        """The calls of the last reply, each still to be answered."""
        last = self.history[-1] if self.history else {}
        return last.get("tool_calls", [])


def _read_tools(path: str) -> list[dict]:
    """--tools FILE: a JSON list of OpenAI function tools, checked as the server checks them."""
    from ..fileio import read_json
    from ..toolcalls import ToolError, check_tools

    tools = read_json(path, ConfigError)
    if not isinstance(tools, list) or not tools:
        raise ConfigError(f"--tools: {path} holds no list of tools ([{{\"type\": \"function\", \"function\": ...}}])")
    try:
        check_tools(tools)
    except ToolError as e:
        raise ConfigError(f"--tools: {path}: {e}") from None
    return tools


def _answer_calls(session: _Session, read: Callable[[str], str] = input) -> None:
    """Show each call of the last reply and take its result from the user, then let the model go on, until a
    reply calls nothing (or the user gives no result: Ctrl-D)."""
    import json

    while session.pending_calls():
        for call in session.pending_calls():
            args = json.dumps(call["function"]["arguments"], ensure_ascii=False)
            print(f"(calls {call['function']['name']}({args}); type its result)", file=sys.stderr)
            result = read(f"{call['function']['name']}> ")
            session.history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        session.answer(sys.stdout, label="bot> ")


def _interactive(session: _Session) -> int:
    """The terminal loop: a line in, a streamed reply out, until Ctrl-D."""
    from ..errors import ChatError, TokenizerError

    print(f"chatting with {session.model.config.n_layer}-layer run (context {session.model.config.block_size} "
          f"tokens). {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            _command(session, text)
            continue
        try:  # "//" escapes a message that starts with "/"
            session.reply(line.replace("//", "/", 1) if text.startswith("//") else line, sys.stdout, label="bot> ")
            _answer_calls(session)
        except (ChatError, TokenizerError) as e:  # a message the vocabulary cannot write: say so, go on
            session.history.pop()
            print(f"(cannot send that: {e})", file=sys.stderr)
        except EOFError:  # no result for a call: the conversation goes on from the next message
            print(file=sys.stderr)


def _command(session: _Session, text: str) -> None:
    name, _, rest = text.partition(" ")
    if name == "/reset":
        session.history, session.last, session.total = [], None, type(session.total)()
        print("(conversation reset)", file=sys.stderr)
    elif name == "/stats":
        print(f"({session.stats()})", file=sys.stderr)
    elif name == "/system":
        try:
            session.system = _system_message(session.tokenizer, rest.strip(), "/system")
        except ConfigError as e:
            print(f"({e}; the system message stays as it was)", file=sys.stderr)
            return
        print(f"(system message {'set' if session.system else 'cleared'})", file=sys.stderr)
    else:
        print(f"(unknown command {name}) {HELP}" if name != "/help" else HELP, file=sys.stderr)


def _system_message(tokenizer, text: str | None, name: str) -> str | None:
    """`text` as the system message (None when blank), checked as it is given: one the vocabulary
    cannot write would make every later message fail, pointing at characters the user never typed."""
    return encodable_flag(tokenizer, text, name) if text and text.strip() else None


def add_chat(sub: argparse._SubParsersAction) -> None:
    """`tinygpt chat` and its flags."""
    p = sub.add_parser("chat", help="chat with a run trained on conversations", description=cmd_chat.__doc__)
    p.add_argument("run", help="a run folder trained on chat data (prepare --format chat)")
    p.add_argument("--prompt", metavar="TEXT", help="answer this one message, print the reply and exit")
    p.add_argument("--system", metavar="TEXT", help="the system message")
    p.add_argument("--max-new-tokens", type=NATURAL, default=256, help="longest reply, in tokens (256)")
    p.add_argument("--temperature", type=Number("float", 0), default=0.8, help="0 always takes the likeliest token")
    p.add_argument("--top-k", type=POSITIVE)
    p.add_argument("--top-p", type=Number("float", 0, 1, low_open=True))
    p.add_argument("--seed", type=seed_type(), help="makes sampling reproducible")
    p.add_argument("--tools", metavar="FILE", help="a JSON list of OpenAI function tools the model may call; "
                   "a call is shown and its result asked for")
    add_speculation_flags(p)
    add_device_flag(p)
    add_quantize_flag(p)
    p.set_defaults(func=cmd_chat, hub_args=("run", "draft"))
