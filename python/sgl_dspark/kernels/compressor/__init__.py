"""Block compression of the CSA/HCA compressors and the lightning indexer's keys ("indexer" kernel
family).

`reference.py` is the torch spec (the pooling, the decode and prefill steps, and the compressed
entries' pool addressing); `pool.py` holds the pooling kernel and its launches, `decode.py` and
`extend.py` the decode/verify and prefill steps built on it, `span.py` the span reads they share,
`entry_rows.py` the entry addressing in Triton, `args.py` the launchers' argument checks;
`pair_pool.py` DeepSeek-V4.1's ratio-2 compressor step at decode / verify.
"""
