"""The generation service: one torchrun job that loads and enables a pipeline once and serves it over HTTP
(docs/serving.md)."""
