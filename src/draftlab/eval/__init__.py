"""Evaluation: answering benchmark questions through the decoding engine."""
