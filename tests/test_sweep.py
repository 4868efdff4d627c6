"""The scaling sweep: the fits recover known laws, the grid is an IsoFLOP grid, a tiny sweep runs end to end."""

import dataclasses
import json
import math

import numpy as np
import pytest

from tinygpt.calc import CHINCHILLA_FIT, LossFit, ScalingLaw, compute_optimal, count_params
from tinygpt.config import GPTConfig
from tinygpt.errors import ConfigError, SweepError
from tinygpt.lab.sweep import (
    SweepSettings,
    fit_frontier,
    fit_isoflops,
    fit_loss,
    fit_parabola_minimum,
    fit_power_law,
    fit_sweep,
    load_fit,
    plan_grid,
    run_sweep,
)

# A known law whose compute-optimal exponents are a = beta / (alpha + beta) = 3/7, b = 4/7:
# different from Chinchilla's 0.5 so a fit that just returns 0.5 fails.
LAW = LossFit(E=1.2, A=30.0, B=80.0, alpha=0.4, beta=0.3)


def isoflop_records(law: LossFit, budgets, noise: float = 0.0, seed: int = 0):
    """Points of an IsoFLOP grid whose losses come from `law` (D = C / 6N), optionally with noise."""
    rng = np.random.default_rng(seed)
    records = []
    for c in budgets:
        n_opt, _ = law.optimal(c)
        for k in np.linspace(-1.5, 1.5, 7):  # sizes from e^-1.5 to e^1.5 times the optimum
            n = n_opt * math.exp(k)
            d = c / (6 * n)
            loss = law.loss(n, d) * (1 + noise * rng.standard_normal())
            records.append({"budget": c, "params": n, "tokens": d, "val_loss": loss})
    return records


def test_power_law_fit_is_exact_on_a_power_law():
    x = np.geomspace(1e3, 1e9, 7)
    law = fit_power_law(x, 3.0 * x**0.7)
    assert law.coef == pytest.approx(3.0, rel=1e-9) and law.exponent == pytest.approx(0.7, rel=1e-9)
    assert law(1e6) == pytest.approx(3.0 * 1e6**0.7)


@pytest.mark.parametrize("bad", [([1.0], [2.0]), ([1.0, 2.0], [1.0, -1.0]), ([5.0, 5.0], [1.0, 2.0])])
def test_power_law_fit_refuses_unusable_points(bad):
    with pytest.raises(ConfigError):
        fit_power_law(*bad)


def test_parabola_vertex_of_an_isoflop_curve():
    n = np.geomspace(1e4, 1e6, 5)
    u = np.log(n) - math.log(1e5)
    vertex = fit_parabola_minimum(n, 2.0 + 0.1 * u**2)
    assert vertex["ok"] and vertex["interior"]
    assert vertex["x"] == pytest.approx(1e5, rel=1e-9) and vertex["loss"] == pytest.approx(2.0)
    assert not fit_parabola_minimum(n, 2.0 - 0.1 * u**2)["ok"]  # a maximum is no minimum
    assert not fit_parabola_minimum(n[:2], [1.0, 2.0])["ok"]


def test_frontier_recovers_known_exponents():
    budgets = [1e14, 1e15, 1e16, 1e17, 1e18]
    frontier = fit_frontier(fit_isoflops(isoflop_records(LAW, budgets)))
    assert frontier["params"]["exponent"] == pytest.approx(3 / 7, abs=1e-6)
    assert frontier["tokens"]["exponent"] == pytest.approx(4 / 7, abs=1e-6)
    # the vertex of each parabola is the law's own optimum (the curve's shape in log N is the same at every C)
    n_opt, d_opt = LAW.optimal(1e16)
    assert frontier["params"]["coef"] * 1e16 ** frontier["params"]["exponent"] == pytest.approx(n_opt, rel=0.05)
    assert frontier["tokens"]["coef"] * 1e16 ** frontier["tokens"]["exponent"] == pytest.approx(d_opt, rel=0.05)
    assert not frontier["extrapolated"]


def test_frontier_exponents_survive_a_little_noise():
    budgets = [1e14, 1e15, 1e16, 1e17, 1e18]
    frontier = fit_frontier(fit_isoflops(isoflop_records(LAW, budgets, noise=0.001, seed=3)))
    assert frontier["params"]["exponent"] == pytest.approx(3 / 7, abs=0.05)
    assert frontier["tokens"]["exponent"] == pytest.approx(4 / 7, abs=0.05)


@pytest.mark.parametrize("law", [CHINCHILLA_FIT, LAW])
def test_parametric_fit_recovers_a_known_law(law):
    n, d = np.meshgrid(np.geomspace(1e6, 1e10, 6), np.geomspace(1e8, 1e12, 6))
    n, d = n.ravel(), d.ravel()
    fit, rms = fit_loss(n, d, [law.loss(a, b) for a, b in zip(n, d)])
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(fit, name) == pytest.approx(getattr(law, name), rel=0.01), name
    assert rms < 1e-6


def test_parametric_fit_needs_enough_positive_points():
    with pytest.raises(ConfigError, match="at least 5"):
        fit_loss([1e6] * 4, [1e8] * 4, [3.0] * 4)
    with pytest.raises(ConfigError, match="positive"):
        fit_loss([1e6] * 6, [1e8] * 6, [3.0] * 5 + [-1.0])


def test_fit_sweep_reports_what_it_could_not_fit():
    fit = fit_sweep(isoflop_records(LAW, [1e15])[:2])
    assert fit["frontier"] is None and fit["loss_fit"] is None
    assert any("frontier" in n for n in fit["notes"]) and any("loss fit" in n for n in fit["notes"])
    full = fit_sweep(isoflop_records(LAW, [1e14, 1e15, 1e16]))
    assert full["frontier"]["params"]["exponent"] == pytest.approx(3 / 7, abs=1e-6)
    assert full["loss_fit"]["implied"]["a"] == pytest.approx(3 / 7, abs=0.01)
    assert full["chinchilla"] == {"a": 0.5, "b": 0.5}
    law = ScalingLaw.from_dict(json.loads(json.dumps(full)))
    assert law.optimal_params(1e15) == pytest.approx(LAW.optimal(1e15)[0], rel=0.05)


def test_grid_is_isoflop_around_chinchillas_size():
    settings = SweepSettings(batch_size=8, block_size=64)
    grid, skipped = plan_grid([1e13, 1e12], vocab_size=100, settings=settings, points=5)
    assert not skipped and len(grid) == 10
    assert sorted({p.budget for p in grid}) == [1e12, 1e13]
    for p in grid:
        # every model of a budget spends the budget, up to rounding to whole steps
        assert abs(p.flops / p.budget - 1) <= 0.5 / p.steps + 1e-9
        assert p.tokens == p.steps * 8 * 64 and p.config.block_size == 64
    middle = [p for p in grid if p.budget == 1e13][2]
    assert middle.params == pytest.approx(compute_optimal(flops=1e13).params, rel=0.2)
    sizes = [p.params for p in grid if p.budget == 1e13]
    assert sizes == sorted(sizes) and len(set(sizes)) == 5


def test_grid_with_given_sizes_skips_what_it_cannot_train():
    settings = SweepSettings(batch_size=4, block_size=16)
    grid, skipped = plan_grid([1e9], vocab_size=30, settings=settings, sizes=[5e3, 5.1e3, 2e4, 1e7])
    assert [p.target for p in grid] == [5e3, 2e4]
    assert any("same shape" in s for s in skipped) and any("steps" in s for s in skipped)
    # a budget that buys the first size one step: "1 step", not "1 steps"
    one_step = 1e9 / grid[0].steps
    grid, skipped = plan_grid([one_step], vocab_size=30, settings=settings, sizes=[5e3])
    assert not grid and skipped[0].endswith(": only 1 step of 4 x 16 tokens (fewer than 10)"), skipped


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budgets": [0.0]}, "budgets"),
        ({"budgets": [-1e12]}, "budgets"),
        ({"budgets": [float("nan")]}, "budgets"),
        ({"budgets": []}, "budgets"),
        ({"budgets": [1e12], "sizes": [-5.0]}, "sizes"),
        ({"budgets": [1e12], "points": 0}, "points"),
        ({"budgets": [1e12], "spread": 1.0}, "spread"),
        ({"budgets": [1e12], "spread": 1e200}, "smaller --spread"),  # an OverflowError's traceback before
        ({"budgets": [1e12], "points": 2100}, "fewer --points"),
    ],
)
def test_grid_refuses_bad_input(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_grid(vocab_size=100, **kwargs)


def test_settings_refuse_bad_values():
    with pytest.raises(ConfigError, match="batch_size"):
        SweepSettings(batch_size=0)
    with pytest.raises(ConfigError, match="lr"):
        SweepSettings(lr=-1.0)


TINY = SweepSettings(batch_size=4, block_size=16, eval_iters=2, device="cpu", lr=3e-3)


def test_tiny_sweep_end_to_end_and_resumable(char_data, tmp_path):
    out = tmp_path / "sweep"
    seen = []
    result = run_sweep(char_data, out, [1e8, 2e8], sizes=[4e3, 1.1e4], settings=TINY, progress=False,
                       on_point=lambda i, n, record, new: seen.append((i, n, new)))
    assert result.trained == 4 and len(result.points) == 4 and not result.interrupted
    assert seen == [(0, 4, True), (1, 4, True), (2, 4, True), (3, 4, True)]
    for record in result.points:
        assert record["status"] == "ok" and math.isfinite(record["val_loss"])
        config = GPTConfig.from_dict(json.loads((out / record["run"] / "config.json").read_text()))
        assert record["params"] == count_params(config).total and config.n_layer == record["n_layer"]
        assert abs(record["flops"] / record["budget"] - 1) < 0.1
        assert (out / record["run"] / "model.safetensors").exists()
        notes = json.loads((out / record["run"] / "train_config.json").read_text())["notes"]
        assert notes["sweep"]["budget"] == record["budget"]
    # results recorded against parameters, tokens and FLOPs; plots drawn
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["points"]) == 4
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].startswith("budget,params") and len(rows) == 5
    fit = json.loads((out / "fit.json").read_text())
    assert fit["points"] == 4 and fit["flops_range"] == [1e8, 2e8]
    for name in ("loss_vs_flops.png", "isoflops.png", "scaling.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in result.plots] == ["loss_vs_flops.png", "isoflops.png", "scaling.png"]

    # a rerun trains nothing; a point whose run finished but was not recorded is picked up from its run
    saved["points"] = saved["points"][:-1]
    (out / "results.json").write_text(json.dumps(saved))
    again = run_sweep(char_data, out, [1e8, 2e8], sizes=[4e3, 1.1e4], settings=TINY, progress=False, plots=False)
    assert again.trained == 1
    assert [r["val_loss"] for r in again.points] == pytest.approx([r["val_loss"] for r in result.points])
    assert run_sweep(char_data, out, [1e8, 2e8], sizes=[4e3, 1.1e4], settings=TINY, progress=False,
                     plots=False).trained == 0

    # other settings in the same folder are refused, and nothing is lost
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(char_data, out, [1e8], sizes=[4e3], settings=SweepSettings(batch_size=8, block_size=16,
                                                                              eval_iters=2, device="cpu"))
    assert len(json.loads((out / "results.json").read_text())["points"]) == 4


def test_sweep_refuses_a_folder_that_is_not_a_sweep(char_data, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match="not empty"):
        run_sweep(char_data, tmp_path, [1e8], sizes=[4e3], settings=TINY, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_settings_train_would_refuse_are_refused_before_the_folder_is_written(char_data, tmp_path):
    # float16 on a CPU used to fail at the first point, after results.json was written with the bad
    # settings, and then the corrected command was refused as "swept with other settings"
    bad = dataclasses.replace(TINY, dtype="float16", device="cpu")
    with pytest.raises(ConfigError, match="float16"):
        run_sweep(char_data, tmp_path / "sweep", [1e8], sizes=[4e3], settings=bad, progress=False)
    assert not (tmp_path / "sweep").exists()


def test_load_fit_reads_a_sweep_and_refuses_a_bad_one(tmp_path):
    fit = fit_sweep(isoflop_records(LAW, [1e14, 1e15, 1e16]), data="somewhere")
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    law = load_fit(tmp_path)
    assert law.params.exponent == pytest.approx(3 / 7, abs=1e-6) and law.source == str(tmp_path)
    assert law.data == "somewhere"
    fit["frontier"]["params"]["coef"] = "big"
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    with pytest.raises(SweepError, match="coef"):
        load_fit(tmp_path)
    with pytest.raises(SweepError, match="no fit.json"):
        load_fit(tmp_path / "elsewhere")
