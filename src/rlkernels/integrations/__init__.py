"""Where rlkernels meets other code: the batch-invariant mode (ATen overrides) and Hugging Face models."""
