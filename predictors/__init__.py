"""Predictor pipeline: activation collection, low-rank predictor training, thresholds, evaluation."""
