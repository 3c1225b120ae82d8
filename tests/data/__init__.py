"""Tests of tasks/data: preparing text into tokens, the dataset warm."""
