import subprocess
import sys

import tinygpt


def run(*args):
    return subprocess.run([sys.executable, "-m", "tinygpt", *args], capture_output=True, text=True, timeout=120)


def test_lesson_tour():
    r = run("lesson")
    assert r.returncode == 0, r.stderr
    assert "parameters: 107,008" in r.stdout
    assert "attn[0]:   [1.0000, 0.0000, 0.0000, 0.0000]" in r.stdout
    assert "step 20: loss=" in r.stdout
    assert "generated: [5, 12, 3," in r.stdout
    assert "6. Pitfall: forgetting the causal mask" in r.stdout and "without mask: '" in r.stdout
    assert "greedy           distinct-4" in r.stdout and "temperature 2.0  distinct-4" in r.stdout
    assert "8. Emergent abilities" in r.stdout and "tinygpt emergence --out runs/emergence" in r.stdout


def test_unknown_command_fails_cleanly():
    r = run("frobnicate")
    assert r.returncode != 0 and "Traceback" not in r.stderr


PUBLIC_API = {
    "GPT", "GPTConfig", "SampleConfig", "TrainConfig", "FinetuneConfig", "KVCache",
    "generate", "generate_stream", "prepare", "train", "finetune", "save", "load", "load_tokenizer", "quantize",
    "TinyGPTError", "ConfigError", "DataError", "TokenizerError", "CheckpointError", "TrainingError",
}  # fmt: skip


def test_public_api_is_small():
    # the exact set: a name added to tinygpt's surface is a decision, made here as well as in __all__
    assert len(tinygpt.__all__) == len(set(tinygpt.__all__))
    assert set(tinygpt.__all__) == PUBLIC_API
    for name in tinygpt.__all__:
        assert hasattr(tinygpt, name)


def test_api_names_are_the_functions_not_the_modules():
    import tinygpt.finetune  # noqa: F401
    import tinygpt.generate  # noqa: F401  (importing the submodules must not shadow the functions)
    import tinygpt.train  # noqa: F401

    assert callable(tinygpt.generate) and callable(tinygpt.train) and callable(tinygpt.load)
    assert callable(tinygpt.finetune) and tinygpt.finetune.__name__ == "finetune"
