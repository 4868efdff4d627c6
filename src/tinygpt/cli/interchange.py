"""Models in and out of tinygpt: `tinygpt export` (a Hugging Face folder or a GGUF file), `import` (a Hugging
Face folder, GPT-2 or the Llama family, into a run; a PEFT adapter into an adapter run) and `merge` (an adapter
run's LoRA adapters into plain weights)."""

from __future__ import annotations

import argparse

from ..errors import ConfigError


def _tokenizer_words(tokenizer) -> str:
    return f"{tokenizer.kind} tokenizer, {tokenizer.vocab_size:,} tokens" if tokenizer is not None else "no tokenizer"


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run as a Hugging Face folder (--format hf) or a GGUF file for llama.cpp (--format gguf).

    Args (flags):
        RUN: a run folder (or a Hugging Face folder: GPT-2, Llama, Qwen2, Qwen3; an adapter run is
            merged on the way).
        --format hf: a folder that transformers' AutoModelForCausalLM, AutoTokenizer and
            pipeline("text-generation") load: config.json, model.safetensors, generation_config.json,
            tokenizer.json and tokenizer_config.json (and chat_template.jinja): GPT2LMHeadModel, or for
            the Llama family LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM.
        --format gguf: one .gguf file with the metadata of llama.cpp's gpt2, llama, qwen2 or qwen3
            architecture, the tokenizer, the chat template and the weights.
        --out: the folder (hf) or file (gguf) to write.
        --dtype: with gguf, float32 (default) or float16 matrices.
    """
    from pathlib import Path

    from ..calc import format_count
    from ..checkpoint import load_run
    from ..run_folder import RunFolder

    src, out = Path(args.run), Path(args.out)
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ConfigError("--out must not be the folder being exported, nor inside it")
    if args.dtype != "float32" and args.format != "gguf":
        raise ConfigError("--dtype applies to --format gguf only")
    model, tokenizer = load_run(src, "cpu", tokenizer_required=args.format == "gguf")
    params = f"{format_count(model.num_params())} parameters"
    tok = _tokenizer_words(tokenizer)
    if args.format == "hf":
        from ..interop.hf import export_hf
        from ..interop.hf_folder import read_hf_config

        export_hf(model, tokenizer, out)
        arch = read_hf_config(out, ConfigError)["architectures"][0]
        print(f"exported {src} to {out} (Hugging Face {arch}: {params}, {tok})")
        print(f"  transformers: AutoModelForCausalLM.from_pretrained('{out}'), AutoTokenizer.from_pretrained('{out}')")
        if tokenizer is None:
            print(f"  note: {src} has no {RunFolder(src).tokenizer_file.name}, so {out} holds the model alone")
    else:
        from ..interop.gguf import export_gguf, gguf_arch, gguf_notes

        export_gguf(model, tokenizer, out, dtype=args.dtype)
        size = out.stat().st_size
        print(f"exported {src} to {out} (GGUF, architecture {gguf_arch(model.config)}, {args.dtype}: {params}, {tok}; "
              f"{size / 1e6:.1f} MB)")
        for note in gguf_notes(model, tokenizer):
            print(f"  note: {note}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Turn a Hugging Face folder (config.json + model.safetensors or shards) of GPT-2, Llama, Qwen2 or
    Qwen3 into a tinygpt run.

    The tokenizer comes along: GPT-2's vocab.json + merges.txt (run by tiktoken), or a
    tokenizer.json (a Llama-family model's with its special tokens, chat template and
    generation_config.json's eos ids). A folder with only pytorch_model.bin is refused: it is a
    pickle, and tinygpt never unpickles a file.

    A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, trained with Hugging Face
    PEFT) becomes an adapter run on --base (default: its base_model_name_or_path, when that is a
    folder): the adapters, the base's path and checksum, its config and tokenizer.
    """
    from ..calc import format_count
    from ..checkpoint import import_hf, import_peft
    from ..run_folder import RunFolder

    if RunFolder(args.dir).is_adapter_run():
        model, tokenizer = import_peft(args.dir, args.out, args.base)
        lora = model.lora_config
        print(f"imported the PEFT adapter {args.dir} to {args.out}: LoRA r={lora.rank}, alpha {lora.alpha:g} on "
              f"{', '.join(lora.targets)} ({format_count(sum(p.numel() for p in model.parameters() if p.requires_grad))} "
              f"adapter parameters), {_tokenizer_words(tokenizer)}")
        return 0
    if args.base is not None:
        raise ConfigError(f"--base is for a PEFT adapter, and {args.dir} is a model folder (no adapter_config.json)")
    model, tokenizer = import_hf(args.dir, args.out)
    run, c = args.out, model.config
    tok = _tokenizer_words(tokenizer)
    print(
        f"imported {args.dir} to {run}: {format_count(model.num_params())} parameters "
        f"({c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, context {c.block_size}), {tok}"
    )
    if tokenizer is None:
        print(f"  note: {args.dir} has no tokenizer, so `tinygpt sample {run}` cannot run until one is added")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Fold an adapter run's LoRA adapters into its base model's weights and write a plain run.

    Args (flags):
        RUN: an adapter run (PEFT's adapter_config.json + adapter_model.safetensors, and
            tinygpt_adapter.json naming its base model), or a PEFT adapter trained elsewhere.
        --out MERGED: the run folder to create (model.safetensors, config.json, tokenizer.json):
            a model like any other, which needs neither the adapters nor the base any more.
        --base: the base model's folder, where it is not the one the run names (a PEFT adapter's
            base_model_name_or_path is used when it is a folder).
    """
    from ..calc import format_count
    from ..checkpoint import merge_run
    from ..run_folder import RunFolder

    model, tokenizer = merge_run(args.run, args.out, args.base)
    info = RunFolder(args.run).adapter_run(args.base)
    lora = info.lora
    print(f"merged {args.run} (LoRA r={lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}) into the "
          f"weights of {info.shown_base}: wrote {args.out} ({format_count(model.num_params())} parameters"
          f"{'' if tokenizer is not None else ', no tokenizer'})")
    return 0


def add_export(sub: argparse._SubParsersAction) -> None:
    """`tinygpt export` and its flags."""
    p = sub.add_parser(
        "export", help="write a run as a Hugging Face folder or a GGUF file",
        description=cmd_export.__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  tinygpt export runs/mine --format hf --out hf/mine\n"
               "  tinygpt export runs/mine --format gguf --out mine.gguf",
    )
    p.add_argument("run", metavar="RUN", help="a run folder (or a Hugging Face folder)")
    p.add_argument("--format", required=True, choices=("hf", "gguf"), help="hf (a folder) or gguf (a file)")
    p.add_argument("--out", required=True, metavar="PATH", help="the folder (hf) or .gguf file (gguf) to write")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                   help="gguf only: the matrices' dtype (norms and biases stay float32)")
    p.set_defaults(func=cmd_export, hub_args=("run",))


def add_import(sub: argparse._SubParsersAction) -> None:
    """`tinygpt import` and its flags."""
    p = sub.add_parser("import", help="turn a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3) into a run, "
                       "or a PEFT adapter into an adapter run",
                       description=cmd_import.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  tinygpt import hf/gpt2 --out runs/gpt2\n"
                              "  tinygpt import peft/my-adapter --base hf/gpt2 --out runs/my-adapter")
    p.add_argument("dir", metavar="DIR", help="a Hugging Face folder (config.json + model.safetensors), "
                   "or a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--out", required=True, metavar="RUN", help="the run folder to create")
    p.add_argument("--base", metavar="DIR", help="a PEFT adapter's base model (a run or a Hugging Face folder)")
    p.set_defaults(func=cmd_import, hub_args=("dir", "base"))


def add_merge(sub: argparse._SubParsersAction) -> None:
    """`tinygpt merge` and its flags."""
    p = sub.add_parser("merge", help="fold an adapter run's LoRA adapters into a plain run",
                       description=cmd_merge.__doc__.split("\n\n")[0],
                       epilog="example:\n  tinygpt merge runs/lora --out runs/merged",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="an adapter run (it names its base model), or a PEFT adapter")
    p.add_argument("--out", required=True, metavar="MERGED", help="the plain run folder to create")
    p.add_argument("--base", metavar="DIR", help="the base model, where it is not the one RUN names")
    p.set_defaults(func=cmd_merge)
