"""The course's last stage, learning from preferences and rewards.

- `tasks`: tasks whose answers a program checks (their prompts, answers, held-out split and TRL-shaped reward).
- `dpo`: per-sequence log-probs of completions, and DPO's losses (TRL's sigmoid, ipo, hinge and robust) and
  metrics (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected)
  as pure functions of them.
- `reward`: a reward model's scores (a text's last token's) and its Bradley-Terry loss, with TRL's margin and
  centering, and metrics (accuracy, margin, min/mean/max reward).

TRL's definitions are the reference: a parity test holds these functions to TRL's trainers.
"""
