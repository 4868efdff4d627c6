"""Tiny Hugging Face folders of the Llama family, made by the tests themselves: random weights from
transformers' own config classes (LlamaConfig, Qwen2Config, Qwen3Config), a tokenizer trained here in
the shape each family's has, and a chat template. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Small models run on a laptop; big ones need a cluster.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1000.",
    "You are a helpful assistant. Answer briefly and kindly.",
] * 20

# A ChatML template as Qwen2.5 and SmolLM2 write theirs (a default system message when there is none)
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's shape: the BOS written by the template, headers, <|eot_id|> ending each turn
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# TinyLlama's (Zephyr's) shape: role lines that are plain text, eos_token after each message, blocks
# that trim_blocks and lstrip_blocks must clean up
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# ChatML with the assistant's replies marked for SFT's loss mask
CHATML_MARKED = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5's template with its tools (Hermes-style <tool_call> JSON; results as <tool_response> in a user turn),
# as its tokenizer_config.json has it, its longest lines split (the same text)
QWEN25_TOOLS = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Llama 3.2's template with its tools (listed in the first user message; a call is bare JSON with "parameters",
# one a turn; results in an ipython turn), as its tokenizer_config.json has it, its longest lines split
LLAMA32_TOOLS = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. " }}
    {{- "To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Numbers: 1 2 3?"},
     {"role": "assistant", "content": "4 5 6."}, {"role": "user", "content": "Le cœur? 🙂"},
     {"role": "assistant", "content": "a sa raison."}],
    [{"role": "user", "content": "def add(a, b):"}],
]


# Qwen2's pre-tokenizer split: digits one by one, letters with one leading non-letter
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def byte_level_tokenizer(specials: list[str], post_bos: str | None = None, qwen: bool = False):
    """A byte-level BPE trained on CORPUS (GPT-2's scheme, as SmolLM2 and Llama 3 have; with qwen, Qwen2's
    split and NFC), the specials added after it; with post_bos, a post-processor that puts it first
    (Llama 3's)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if post_bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{post_bos}:0 $A:0",
                                                           special_tokens=[(post_bos, tok.token_to_id(post_bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_tokenizer():
    """A SentencePiece-style BPE as TinyLlama's tokenizer.json has it: "▁" for spaces prepended by the
    normalizer, no pre-tokenizer, <unk> <s> </s> first, then 256 <0xNN> byte tokens to fall back on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    learner.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(vocab_size=300, min_frequency=2,
                                                                    show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", special_tokens=[("<s>", 1)])
    return tok


# The tokenizer styles, each as its family's Hub folder has it: (tokenizer, tokenizer_config.json's class,
# special tokens and flags, chat template). transformers 5 rebuilds some classes' pipelines itself
# (Qwen2Tokenizer, LlamaTokenizer): these are the files for which its result is the real models'.
def tokenizer_style(style: str):
    if style == "qwen":  # Qwen2.5 / Qwen3
        tok = byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], qwen=True)
        return tok, {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                     "bos_token": None, "split_special_tokens": False}, CHATML
    if style == "qwen25-tools":  # Qwen2.5 with its tool-calling template
        tok, special, _ = tokenizer_style("qwen")
        return tok, special, QWEN25_TOOLS
    if style == "llama32-tools":  # Llama 3.2 with its tool-calling template
        tok, special, _ = tokenizer_style("llama3")
        return tok, special, LLAMA32_TOOLS
    if style == "smollm":  # SmolLM2, here with the replies marked for SFT
        tok = byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        return tok, {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                     "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}, CHATML_MARKED
    if style == "llama3":  # Llama 3.2
        tok = byte_level_tokenizer(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                    "<|eot_id|>"], post_bos="<|begin_of_text|>")
        return tok, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                     "eos_token": "<|eot_id|>"}, LLAMA3
    if style == "zephyr":  # TinyLlama-Chat
        tok = sentencepiece_tokenizer()
        return tok, {"tokenizer_class": "LlamaTokenizer", "legacy": False, "bos_token": "<s>", "eos_token": "</s>",
                     "unk_token": "<unk>", "pad_token": "</s>", "add_bos_token": True, "add_eos_token": False}, ZEPHYR
    raise ValueError(style)


def model_config(kind: str, vocab_size: int, *, tied: bool, **overrides):
    """transformers' config of a tiny model of `kind`: GQA and Llama 3's rope scaling (llama), q/k/v
    biases (qwen2), qk-norm and a head wider than hidden / heads (qwen3)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                  initializer_range=0.3)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 2, "rope_theta": 500000.0,
                                          "rope_scaling": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                               high_freq_factor=4.0, original_max_position_embeddings=16),
                                          **overrides})
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "num_key_value_heads": 1, "rope_theta": 1e6, **overrides})
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6,
                                          **overrides})
    else:
        raise ValueError(kind)
    return cfg


def make_folder(root: Path, kind: str, style: str, *, tied: bool = True, dtype: torch.dtype = torch.float32,
                shard: str | None = None, stop: list[str] | None = None, jinja_file: bool = True,
                seed: int = 0) -> Path:
    """A Hugging Face folder of a random tiny `kind` model with a `style` tokenizer and template, as
    save_pretrained writes it (model.safetensors, or shards of at most `shard` with an index)."""
    import transformers

    tok, special, template = tokenizer_style(style)
    root.mkdir(parents=True, exist_ok=True)
    vocab = -(-tok.get_vocab_size() // 8) * 8  # padded past the tokenizer, as Qwen's is
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(kind, vocab, tied=tied)).eval()
    ids = [tok.token_to_id(t) for t in (stop or [special["eos_token"]])]
    model.generation_config.eos_token_id = ids if len(ids) > 1 else ids[0]
    model.to(dtype).save_pretrained(root, **({"max_shard_size": shard} if shard else {}))
    tok.save(str(root / "tokenizer.json"))
    settings = {"model_max_length": 128, **{k: v for k, v in special.items() if v is not None}}
    if jinja_file:
        (root / "chat_template.jinja").write_text(template)
    else:
        settings["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(settings))
    return root
