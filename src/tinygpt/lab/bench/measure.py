"""One bench run: the machine and its limits, then the training and generation rows the plan asks for,
and the ratios between them, as one JSON-ready dict (tinygpt.lab.bench's docstring says what each
section measures)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...device import resolve_device
from .dpo import dpo_rows
from .generation import generation_rows
from .grpo import grpo_rows
from .machine import describe_cpu, describe_limits, limits, load_average, machine
from .peers import llama_available, peers_available
from .plans import SMOKE, Plan, plan_for
from .report import ratios
from .step import step_rows
from .training import training_rows


def run(
    *, quick: bool = False, sections: tuple[str, ...] = ("limits", "train", "step", "generate", "dpo", "grpo"),
    peers: bool = True, log: Callable[[str], None] = print, plan: Plan | None = None, device: str = "auto",
    smoke: bool = False,
) -> dict[str, Any]:
    """Measure and return everything as one JSON-ready dict (see the module docstring).

    Args:
        quick: the short plan (fewer models, steps and repeats).
        smoke: every kind of row once at the smallest sizes (SMOKE): that the bench runs, in seconds.
        plan: what to measure, instead of the one plan_for picks.
        device: where to measure (resolve_device's names; "auto" picks cuda where there is one).
        sections: any of "limits", "train", "step", "generate", "dpo" and "grpo" (a DPO or a GRPO step beside
            TRL's, on a CPU).
        peers: measure transformers and llama.cpp beside tinygpt (those installed).
        log: called with a line per measurement, as it is taken.
    """
    device = resolve_device(device)
    plan = plan or plan_for(device, quick=quick, smoke=smoke)
    want_peers = peers
    peers = want_peers and peers_available()
    llama = want_peers and llama_available()
    if want_peers and not peers:
        log("transformers is not installed (pip install 'tinygpt[hf]'): measuring tinygpt without it")
    if want_peers and not llama and plan.llama_models:
        log("llama.cpp is not installed (pip install 'tinygpt[hf,llama]', which builds it from source in about "
            "10 minutes): measuring tinygpt without it")
    result: dict[str, Any] = {"quick": quick, "smoke": plan is SMOKE, "machine": machine(device), "peers": peers,
                              "llama": llama}
    log(describe_cpu(result["machine"]))
    started = time.perf_counter()
    lim = limits(plan, device)  # MFU and bandwidth use need them, so they are always measured
    result["limits"] = lim
    log(describe_limits(lim))
    if "train" in sections:
        result["training"] = training_rows(plan, device, lim, peers, log)
    if "step" in sections and plan.step_sizes:
        result["steps"] = step_rows(plan, device, log)
    if "generate" in sections:
        result["generation"] = generation_rows(plan, device, lim, peers, llama, log)
    if "dpo" in sections and plan.dpo is not None and device.type == "cpu":
        result["dpo"] = dpo_rows(*plan.dpo, want_peers, log)
    if "grpo" in sections and plan.grpo is not None and device.type == "cpu":
        result["grpo"] = grpo_rows(*plan.grpo, want_peers, log)
    result["ratios"] = ratios(result)
    result["machine"]["load_average_end"] = load_average()
    result["seconds"] = time.perf_counter() - started
    return result
