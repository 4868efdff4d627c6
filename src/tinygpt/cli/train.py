"""`tinygpt train`: the flags and config file into a GPTConfig (or the sizing policy's choice) and a
TrainConfig, then one training run."""

from __future__ import annotations

import argparse
import os
import sys

from ..calc.units import plural
from ..config.model import ARCHS, MLPS
from ..config.train import DATA_ORDERS
from ..errors import ConfigError
from .common import (EXIT_NONFINITE, EXIT_SIGNAL, FRACTION, NATURAL, POSITIVE, RATE, Number, add_device_flag,
                     kept_checkpoint, seed_type, time_trained)

# every GPTConfig field is a config-file key; the common ones are flags too
MODEL_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_weights",
                "activation", "init", "layer_norm_eps", "scale_embeddings", "arch", "positions", "norm", "mlp",
                "intermediate_size", "n_kv_head", "head_size", "qk_norm", "qkv_bias", "rope_theta", "rope_scaling",
                "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context", "zero_init")


def train_settings(args: argparse.Namespace) -> tuple[dict, dict, str | None]:
    """Model and training overrides from the config file, then the flags (flags win)."""
    import dataclasses
    import tomllib

    from ..config.duration import parse_duration
    from ..config.train import TrainConfig

    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict = {}
    if getattr(args, "config", None):
        try:
            with open(args.config, "rb") as f:
                values = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{args.config}: not valid TOML ({e})") from None
        unknown = sorted(set(values) - train_fields - set(MODEL_FIELDS) - {"preset"})
        if unknown:
            raise ConfigError(f"{args.config}: unknown key(s): {', '.join(unknown)}")
    for name in (*MODEL_FIELDS, *train_fields, "preset"):
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
    for name in ("max_time", "dist_timeout"):
        if isinstance(values.get(name), str):
            values[name] = parse_duration(values[name], "--" + name.replace("_", "-"))
    preset = values.pop("preset", None)
    model = {k: v for k, v in values.items() if k in MODEL_FIELDS}
    train = {k: v for k, v in values.items() if k in train_fields}
    return model, train, preset


def cmd_train(args: argparse.Namespace) -> int:
    """Train a GPT on a prepared data folder; checkpoints and metrics.jsonl go to the run folder.

    Under `torchrun --nproc_per_node=N -m tinygpt train ...` the N processes train one model
    (DDP, or FSDP2 with --fsdp); --batch-size is per process; rank 0 writes and prints.

    Without --preset or size flags (--n-layer, --n-head, --n-embd) the model is chosen for you:
    with --max-time it is sized for the compute that time buys on this machine (the speed measured
    in a few seconds) by Chinchilla's rule, or by a sweep's fit with --sweep DIR, and the choice is
    printed (on stderr) and kept in train_config.json; without it, a default for the size of the data.
    """
    from ..config.fields import from_mapping
    from ..config.train import TrainConfig
    from ..device import resolve_device
    from ..distributed import process_group
    from ..errors import NonFiniteError
    from ..run_folder import RunFolder
    from ..train.loop import train

    model_over, train_over, preset = train_settings(args)
    folder = RunFolder(args.out)
    resume = args.resume and folder.has_weights()
    begun = None  # the model a run killed before its first save was started with
    if not resume:  # before a time budget's sizing: a folder holding a run (or its lost weights' state), a file
        folder.check_new()
    if args.resume and not resume:
        begun = folder.begun_with()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.sweep and (resume or begun or preset or distributed):
        why = ("--preset" if preset else f"--resume: {args.out} already has its model" if resume or begun
               else "torchrun: each process would time itself; give the model (--preset or size flags)")
        raise ConfigError(f"--sweep sizes a new model: it does not go with {why}")
    if args.resume and not resume and os.environ.get("RANK", "0") == "0":
        again = "it over with the settings it began with" if begun else "a new run there"
        print(f"no checkpoint in {args.out} yet: starting {again}", file=sys.stderr)
    if resume or begun:
        model_cfg, train_cfg = _resumed_configs(folder, model_over, train_over, preset, begun)
    else:
        model_over, train_over = with_recipe(model_over, train_over, preset)
        train_cfg = from_mapping(TrainConfig, train_over)
        model_cfg = _new_model(args, train_cfg, model_over, preset, distributed)
    # under torchrun the processes stay in one group until rank 0 has printed: torchrun ends the
    # whole job as soon as one process exits with a non-zero code (143 after SIGTERM, say)
    with process_group(resolve_device(train_cfg.device), train_cfg.dist_timeout) as ctx:
        try:
            probes = []
            if args.probe_interval:
                from ..lab.probes import Probes

                probes.append(Probes(args.probe_interval, data=args.data))
            result = train(args.data, args.out, model_cfg, train_cfg, resume=resume, progress=not args.quiet,
                           callbacks=probes)
        except NonFiniteError as e:
            if ctx.is_main:
                print(f"tinygpt: error: {e}; {kept_checkpoint(args.out)}", file=sys.stderr)
            return EXIT_NONFINITE
        if ctx.is_main:
            val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
            loss = f", train loss {result.train_loss:.4f}" if result.train_loss is not None else ""
            procs = f" on {ctx.world_size} processes" if ctx.enabled else ""
            print(
                f"{result.stopped}: {plural(result.step, 'step')}{procs}, {result.tokens:,} tokens in "
                f"{time_trained(result)}{loss}{val}; saved to {result.run}",
                flush=True,
            )
        ctx.barrier()
    return EXIT_SIGNAL.get(result.stopped, 0)


def with_recipe(model_over: dict, train_over: dict, preset: str | None) -> tuple[dict, dict]:
    """A new run's model and training settings with the recipe (config.RECIPE_MODEL, RECIPE_TRAIN)
    under them: its model choices where neither --arch nor --preset gives the model, its optimizer
    and schedule where no flag names one (AdamW under --fsdp, which Muon does not shard)."""
    from ..config.train import RECIPE_MODEL, RECIPE_TRAIN

    if "arch" not in model_over and not preset:
        model_over = {**RECIPE_MODEL, **model_over}
    recipe = {**RECIPE_TRAIN, "optimizer": "adamw"} if train_over.get("fsdp") else RECIPE_TRAIN
    return model_over, {**recipe, **train_over}


def _resumed_configs(run, model_over: dict, train_over: dict, preset: str | None, begun=None):
    """(model, TrainConfig) to continue `run` (a RunFolder) with, or to start it over (`begun`, its
    recorded ModelChoice): its saved settings with the flags over them. The model is None on resume
    (the run's own) and `begun` on a start over, a new GPTConfig only when --preset or a model flag
    changes the saved one."""
    from ..config.fields import from_mapping
    from ..config.model import GPTConfig, with_arch
    from ..config.train import TrainConfig

    saved, _ = run.train_config()
    train_cfg = from_mapping(TrainConfig, {**saved.to_dict(), **train_over})
    if not (model_over or preset):
        return begun, train_cfg
    base = (GPTConfig.from_preset(preset) if preset else begun.config if begun else run.model_config()).to_dict()
    return from_mapping(GPTConfig, with_arch(base, model_over)), train_cfg


def _new_model(args: argparse.Namespace, train_cfg, model_over: dict, preset: str | None, distributed: bool):
    """The model of a new run: the preset with the model flags over it, else the one sizing chooses."""
    import dataclasses

    from ..config.fields import from_mapping
    from ..config.model import GPTConfig, with_arch
    from ..data.folder import load_data
    from ..sizing import SIZE_FIELDS, ModelChoice, choose_model
    from ..train.objectives import check_has_val

    dataset = load_data(args.data)
    check_has_val(dataset)  # before a time budget's speed is measured
    meta = dataset.meta
    vocab = int(meta["vocab_size"])
    if preset:
        base = GPTConfig.from_preset(preset, vocab_size=vocab).to_dict()
        config = from_mapping(GPTConfig, with_arch(base, model_over))
        flags = " with its flags over it" if model_over else ""
        return ModelChoice(config, "preset", f"model: the {preset} preset{flags}")  # recorded, as any choice
    # one path for every default: sized for --max-time when no size flag is given, else for the
    # data; under torchrun the data's default, which every process computes alike
    sweep = None
    if args.sweep:
        from ..lab.sweep import load_fit

        sweep = load_fit(args.sweep)
    sizing = dataclasses.replace(train_cfg, max_time=None) if distributed else train_cfg
    choice = choose_model(vocab, int(meta["train_tokens"]), int(meta["val_tokens"]), sizing,
                          fixed=model_over, sweep=sweep)
    if choice.plan is not None:  # on stderr beside the progress: stdout keeps the one result line
        print(choice.reason, file=sys.stderr, flush=True)
    elif (distributed and train_cfg.max_time is not None and not any(f in model_over for f in SIZE_FIELDS)
          and os.environ.get("RANK", "0") == "0"):
        print(f"torchrun: --max-time does not size the model (each process would time itself); {choice.reason}",
              file=sys.stderr, flush=True)
    return choice  # train() records it and trains at its learning rate unless --lr is given


# the defaults the training flags' help shows, for train; finetune shows its own (cli/finetune.py)
TRAIN_DEFAULTS = dict(batch_size="12", lr="1e-3; a model sized for --max-time gets one for its width", warmup="100",
                      max_iters="2000 unless --max-time is given", weight_decay="0.1", eval_interval="250",
                      eval_iters="20", schedule="wsd for a new run, the recipe's; cosine is GPT-2's and nanoGPT's",
                      optimizer="muon for a new run, the recipe's (adamw under --fsdp)")
# how MUON_LR was chosen, as --help says it
MUON_MEASURED = ("the best of 0.01, 0.02, 0.04 and 0.08 for a 4 x 128 llama block on characters, 300 steps of "
                 "16 x 64 tokens, Zen 5; GPT-2's block did 1%% better at 0.04")


def add_training_flags(t: argparse._ArgumentGroup, shown: dict[str, str]) -> None:
    """The optimization flags train and finetune share (each a TrainConfig field), their help naming the
    command's defaults (`shown`: TRAIN_DEFAULTS' keys)."""
    from ..config.train import DECAY_FRACTION, LR_SCHEDULES, MUON_LR, MUON_MOMENTUM, OPTIMIZERS

    t.add_argument("--batch-size", type=POSITIVE, help=f"sequences per micro-step, per process ({shown['batch_size']})")
    t.add_argument("--grad-accum", type=POSITIVE, help="micro-steps per optimizer step (1)")
    t.add_argument("--lr", type=RATE, help=f"peak learning rate ({shown['lr']})")
    t.add_argument("--min-lr", type=Number("float", 0), help="end of the cosine or wsd decay (lr/10)")
    t.add_argument("--warmup", type=NATURAL,
                   help=f"linear warmup steps, at most a tenth of the run's so that a short run decays too "
                        f"({shown['warmup']})")
    t.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                   help=f"after the warmup: cosine decay to --min-lr, constant, inverse-sqrt, or wsd (held, then a "
                        f"linear decay to --min-lr over the last --decay-fraction of the steps) ({shown['schedule']})")
    t.add_argument("--decay-fraction", type=Number("float", 0, 1, low_open=True),
                   help=f"wsd: the share of the steps the decay takes ({DECAY_FRACTION:g})")
    t.add_argument("--max-iters", type=POSITIVE, help=f"optimizer steps ({shown['max_iters']})")
    t.add_argument("--max-time", type=Number("duration", keep_text=True), help="wall-clock budget, e.g. 90s, 5m, 1h")
    t.add_argument("--weight-decay", type=Number("float", 0),
                   help=f"AdamW weight decay on matrices ({shown['weight_decay']})")
    t.add_argument("--beta1", type=FRACTION)
    t.add_argument("--beta2", type=FRACTION)
    t.add_argument("--optimizer", choices=OPTIMIZERS,
                   help=f"adamw for every weight, or muon (torch.optim.Muon) for the weight matrices inside the "
                        f"blocks beside AdamW at --lr for the embeddings, head, norms and biases ({shown['optimizer']})")
    t.add_argument("--muon-lr", type=RATE,
                   help=f"muon: the block matrices' peak rate, on --lr's schedule ({MUON_LR:g}: {MUON_MEASURED})")
    t.add_argument("--muon-weight-decay", type=Number("float", 0),
                   help="muon: decoupled weight decay on the block matrices (0)")
    t.add_argument("--muon-momentum", type=FRACTION, help=f"muon: Nesterov momentum ({MUON_MOMENTUM:g})")
    t.add_argument("--grad-clip", type=Number("float", 0), help="max gradient norm, 0 = off (1.0)")
    t.add_argument("--eval-interval", type=POSITIVE,
                   help=f"steps between evaluations and checkpoints ({shown['eval_interval']})")
    t.add_argument("--eval-iters", type=POSITIVE, help=f"batches per evaluation ({shown['eval_iters']})")
    t.add_argument("--seed", type=seed_type(), help="initialization, dropout and batch order (1337)")
    add_device_flag(t, None, help="auto, cpu, cuda, cuda:N, mps")
    t.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: bfloat16 autocast where the hardware multiplies it natively, "
                        "CUDA GPUs and CPUs with AVX-512 BF16 or AMX; else float32)")


def add_train(sub: argparse._SubParsersAction) -> None:
    """`tinygpt train` and its flags."""
    p = sub.add_parser("train", help="train a GPT on a prepared data folder", description=cmd_train.__doc__)
    p.add_argument("--data", required=True, help="a folder written by `tinygpt prepare`")
    p.add_argument("--out", required=True, help="the run folder to create (or continue with --resume)")
    p.add_argument("--preset", help="start from a preset: lesson, stretch, baby, gpt2, ...")
    p.add_argument("--config", help="a TOML file with any of the settings below (flags override it)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--sweep", metavar="DIR",
                   help="with --max-time and no size flags: size the model by this `tinygpt sweep` folder's fit "
                        "(default: Chinchilla's rule)")
    m = p.add_argument_group("model (default: the modern block, sized for --max-time on this machine, else for the "
                             "data; `tinygpt bench --recipes` measured it against GPT-2's, the README has the table)")
    m.add_argument("--n-layer", type=POSITIVE)
    m.add_argument("--n-head", type=POSITIVE)
    m.add_argument("--n-embd", type=POSITIVE)
    m.add_argument("--block-size", type=POSITIVE)
    m.add_argument("--dropout", type=FRACTION)
    m.add_argument("--vocab-size", type=POSITIVE, help="default: the data's vocabulary")
    m.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None)
    m.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="share the token embedding with the head (on for --arch and --preset models; a new run "
                        "without them has an untied head)")
    m.add_argument("--activation", choices=["gelu", "gelu_tanh"], help="a gelu MLP's GELU (gelu_tanh)")
    m.add_argument("--init", choices=["gpt2", "torch"])
    m.add_argument("--zero-init", action=argparse.BooleanOptionalAction, default=None,
                   help="each block's output projections (attention's and the MLP's) start at zero (on for a new "
                        "run without --arch or --preset, else off)")
    m.add_argument("--arch", choices=ARCHS,
                   help="gpt2 or llama: rotary positions, RMSNorm, a SwiGLU MLP, no biases, HF's module names, and "
                        "the choices below. A new run without --arch or --preset trains the modern block: llama with "
                        "--qk-norm --zero-init --no-tie-weights (--arch gpt2: GPT-2's block, as before)")
    m.add_argument("--n-kv-head", type=POSITIVE, help="llama: key/value heads, dividing --n-head (grouped-query "
                                                      "attention; default n_head)")
    m.add_argument("--mlp", choices=MLPS, help="llama: swiglu (the default), gelu, or relu2 (up, ReLU squared, down; "
                                                "export refuses it: no Hugging Face or llama.cpp architecture has it)")
    m.add_argument("--intermediate-size", type=POSITIVE,
                   help="the MLP's width (gelu and relu2 4 n_embd; swiglu 8/3 n_embd)")
    m.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="llama: RMSNorm on each head's queries and keys (Qwen3; on for a new run without --arch)")
    m.add_argument("--rope-theta", type=Number("float", 1, low_open=True), help="llama: the rotary base (10000)")
    t = p.add_argument_group("training")
    add_training_flags(t, TRAIN_DEFAULTS)
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    t.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP")
    t.add_argument("--data-order", choices=DATA_ORDERS,
                   help="random windows (nanoGPT's sampling), or sequential: consecutive windows streamed through "
                        "the train split, each process reading its own rows, the position kept in the checkpoint "
                        "(default: sequential for a folder of shards, random for one file)")
    t.add_argument("--probe-interval", type=POSITIVE, metavar="N",
                   help="every N steps, log each head's induction and previous-token scores, the loss on repeated "
                        "random sequences' second copy and an in-context learning score to metrics.jsonl (off)")
    t.add_argument("--dist-timeout", metavar="T", type=Number("duration", keep_text=True),
                   help="under torchrun: how long a process waits for the others before the job fails (10m)")
    p.set_defaults(func=cmd_train)
