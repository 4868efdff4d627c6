"""Experiments and measurements built on the library: the lesson's worked examples (lesson), few-shot
prompting (fewshot), probes of induction and previous-token heads (probes) and the lab that watches
them form (emergence), pictures (viz), scaling sweeps (sweep), training speed (throughput) and the
benchmark (bench). Nothing in the core imports them."""
