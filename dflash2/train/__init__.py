"""Drafter training: data synthesis from the target, block training, evaluation, export."""
