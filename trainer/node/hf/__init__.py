"""Fine-tuning Hugging Face causal LMs: what `trainer train` does when `model.name_or_path` is set.

- `chat`: conversations/messages rendered with the tokenizer's chat template, assistant-only labels;
- `dataset`: data.path read, its format detected, samples tokenized, over-long ones truncated or
  dropped, the eval split;
- `packing`: samples packed into `model.max_length` rows;
- `batches`: rows sharded across ranks by step (exact resume), padded micro-batches, eval batches;
- `model`: the model directory checked and loaded, the loss wrapper the engines train;
- `lora`: the `lora` config section and peft;
- `final`: `OUTPUT_DIR/final/` (save_pretrained: full model or adapter, plus tokenizer);
- `job`: the two halves `trainer.node.train` calls (before and after the process group starts).

Modules whose config sections the controller loads (`lora`, `evaluation`) import no torch at the top.
"""
