"""Model specs (`model=` group): each resolves to a Hugging Face checkpoint that both engines load."""
