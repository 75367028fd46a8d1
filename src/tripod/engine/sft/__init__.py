"""Supervised fine-tuning (`tripod train-sft`): config schema, chat-row data with assistant masks, the SFT loop."""
