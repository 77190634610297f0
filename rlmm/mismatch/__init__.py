"""Measuring where the two sides differ: the mismatch metrics and KL estimators, attribution by component and by layer, MoE routing (`routing=`) and the update's loss statistics."""
