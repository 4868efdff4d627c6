"""Experiments and measurements built on the library: the lesson's worked examples (lesson), few-shot
prompting (fewshot), probes of induction and previous-token heads (probes) and the lab that watches
them form (emergence), pictures (viz), scaling sweeps (sweep) and the benchmark (bench). A layer of its
own above the workflows: nothing in the core imports them (tests/test_layers.py holds it)."""
