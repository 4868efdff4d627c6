"""`tinygpt sample` on runs that once broke it: a top_p too small for float32, a padded vocabulary."""

import pytest
from server_util import tiny_model, tiny_tokenizer

import tinygpt
from tinygpt import cli
from tinygpt.tokenizer import CharTokenizer


def tinygpt_cli(capsys, *args):
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tinygpt.save(tiny_model(), tmp_path_factory.mktemp("sample") / "run", tiny_tokenizer())


def test_a_top_p_below_float32s_smallest_value_samples_the_most_likely_token(run, capsys):
    args = ("sample", run, "--prompt", "hello", "--max-new-tokens", 30, "--device", "cpu")
    code, greedy, err = tinygpt_cli(capsys, *args, "--greedy")
    assert code == 0, err
    for p in ("1e-300", "5e-324"):  # once: "the next-token probabilities are NaN or infinite" (blaming the weights)
        code, out, err = tinygpt_cli(capsys, *args, "--top-p", p, "--seed", 1)
        assert code == 0 and err == "", err
        assert out == greedy  # only the most likely token survives the filter


def test_a_padded_vocabulary_never_samples_past_the_tokenizer(tmp_path, capsys):
    # `train --vocab-size 64` on 28-character data: 36 ids the tokenizer cannot decode
    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz .")
    run = tinygpt.save(tiny_model(vocab_size=64), tmp_path / "padded", chars)
    for seed in range(3):
        code, out, err = tinygpt_cli(capsys, "sample", run, "--prompt", "the cat", "--temperature", 1.5,
                                     "--max-new-tokens", 200, "--seed", seed, "--device", "cpu")
        assert code == 0, err
        assert out.startswith("the cat") and len(out) == len("the cat") + 200 + 1  # every token decoded, then "\n"
        assert set(out[:-1]) <= set(chars.decode(range(28)))


def test_a_reader_that_goes_away_ends_sample_quietly(run):
    import subprocess
    import sys

    # `tinygpt sample RUN | head -c 10`: the error line "[Errno 32] Broken pipe" used to follow
    p = subprocess.Popen([sys.executable, "-m", "tinygpt", "sample", str(run), "--max-new-tokens", "200000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == cli.EXIT_PIPE == 141 and err == "", err


def test_a_prompt_that_is_not_utf8_is_refused_naming_the_flag(tmp_path, capsys):
    import os

    from tinygpt.tokenizer import BPETokenizer

    # `--prompt $'\xff'`: Python keeps the byte as a lone surrogate, which the tokenizers library
    # refused in its own words ("TextEncodeInput must be Union[...]")
    bpe = BPETokenizer.train(["the cat sat on the mat. " * 20], 300)
    run = tinygpt.save(tiny_model(vocab_size=bpe.vocab_size), tmp_path / "bpe", bpe)
    bad = os.fsdecode(b"ok \xff")
    for flags in (["--prompt", bad], ["--stop", bad]):
        code, out, err = tinygpt_cli(capsys, "sample", run, *flags, "--max-new-tokens", 3, "--device", "cpu")
        assert code == 2 and out == ""
        assert err == f"tinygpt: error: {flags[0]}: not valid UTF-8 text (byte 0xff at character 4)\n"


def test_compile_refuses_a_model_on_cpu_kernels_in_one_line(run, capsys):
    # torch.compile cannot trace the CPU kernels --quantize converts a model for (fbgemm's, tinygpt's own)
    from tinygpt.interop.quantize import fbgemm_works

    if not fbgemm_works():
        pytest.skip("no fbgemm here: int8 decodes on PyTorch's own operators, which compile")
    code, out, err = tinygpt_cli(capsys, "sample", run, "--compile", "--quantize", "int8", "--max-new-tokens", 5,
                                 "--device", "cpu")
    assert code == 2 and err.count("\n") == 1 and "torch.compile cannot trace" in err, err
