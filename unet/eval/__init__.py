"""Measuring the model: the scene detector, the evaluation's prompts and scores (prompt following and
word maps), the control evaluation, report writing, scaling over snapshots and the benchmark."""
