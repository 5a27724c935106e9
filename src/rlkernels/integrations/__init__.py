"""Where rlkernels meets other code: the batch-invariant mode (ATen overrides, :mod:`.aten_mode`),
Hugging Face models (:mod:`.hf`) and trainers (:mod:`.trainers`: TRL, verl, FSDP2)."""
