"""sglang-dspark inside SGLang: a serve backend (``sglang serve --model-type dspark``) and
kernel hooks on SGLang's own DeepSeek-V4 model, each behind an ``--enable-dspark-*`` flag."""
