"""tracer.formulas: the maths (losses, advantages, KL estimators), derived fields and summary values."""
