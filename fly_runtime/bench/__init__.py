"""``fly bench``: speed on Spec-Bench and accuracy retention on GSM8K / HumanEval, against plain decoding."""
