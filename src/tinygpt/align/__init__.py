"""The course's last stage, learning from preferences and rewards.

- `tasks`: tasks whose answers a program checks (their prompts, answers, held-out split and TRL-shaped reward).
- `pairs`: what the objectives on preference pairs share (the pairs fitted to the window, drawn at random,
  evaluated in order).
- `dpo`: per-sequence log-probs of completions, and DPO's losses (TRL's sigmoid, ipo, hinge and robust) and
  metrics (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected)
  as pure functions of them; the reference (a frozen model, or a LoRA policy's adapters off) and DPO, the
  objective the training loop takes.
- `reward`: a reward model's scores (a text's last token's) and its Bradley-Terry loss, with TRL's margin and
  centering, and metrics (accuracy, margin, min/mean/max reward); BradleyTerry, the objective that trains
  one.
- `preferences`: what a model prefers on pairs (pair accuracy, each side's mean, their margin).

TRL's definitions are the reference: a parity test holds these functions to TRL's trainers.
"""
