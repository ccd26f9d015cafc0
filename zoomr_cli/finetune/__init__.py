"""``zoomr finetune``: teach a model to summarize its own reasoning (ZoomR §3.2).

augment (summary data augmentation, pure text) → summarizer (a zoomr model writes the summaries) →
data (token ids and loss masks through the chat template) → hf_model (the transformers model and
tokenizer converted from what zoomr loads) → train (LoRA, checkpoints, resume) → export (merged HF
directory and model card) ← pipeline (the stages in order, resumable). peft and transformers are the
``finetune`` extra; they are imported only inside the functions that need them.
"""
