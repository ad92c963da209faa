"""The video families' patches (Wan, HunyuanVideo, HunyuanVideo 1.5, LTX, LTX-2, CogVideoX)."""
