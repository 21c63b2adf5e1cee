"""A prompt as a loaded model's token ids, and the check that it fits the model's context."""

import torch

from kvtier.errors import ContextTooLongError
from kvtier.models.loader import LoadedModel
from kvtier.units import counted


def prompt_ids(llm, prompt: str, tokenizer=None) -> torch.Tensor:
    """Token ids of `prompt` as a single user turn (chat template when the model has one), shape [1, n]. `llm`: a
    kvtier.load_model() result, or a transformers model with its `tokenizer` (LoadedModel.wrap)."""
    llm = LoadedModel.wrap(llm, tokenizer)
    if llm.has_chat_template:
        messages = [{"role": "user", "content": prompt}]
        ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    else:
        ids = llm.tokenizer(prompt)["input_ids"]
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    return torch.tensor([list(ids)], dtype=torch.long)


def check_context(llm, prompt_tokens: int, max_new_tokens: int) -> None:
    total = prompt_tokens + max_new_tokens
    if total > llm.context_length:
        raise ContextTooLongError(
            f"prompt of {counted(prompt_tokens, 'token')} + {counted(max_new_tokens, 'new token')} exceeds the "
            f"{llm.context_length}-token context of {llm.name}; shorten the input or lower --max-new-tokens"
        )
