"""How `load_model` fills a model's weights (`load_format`, vLLM's option of the same name): `auto` loads them,
`dummy` gives seeded random weights in the model's architecture (kvtier.models.loader says when that is useful).

Apart from the loader, which imports torch and transformers, so that the command line offers them at once.
"""

LOAD_FORMATS = ("auto", "dummy")
