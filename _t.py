import time, numpy as np
from tokenizers import Tokenizer, models, decoders, pre_tokenizers
from dsv41_jax import engram_layout as EL
alpha = list(pre_tokenizers.ByteLevel.alphabet())
rng = np.random.default_rng(0)
vocab = {}
while len(vocab) < 129000:
    n = int(rng.integers(1, 9))
    vocab.setdefault("".join(rng.choice(alpha, n)), len(vocab))
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.decoder = decoders.ByteLevel()
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.save("/tmp/big_tok.json")
t0 = time.time(); tm = EL.build_compressed_token_map(tok, 129280); print("build", time.time()-t0, tm.max()+1)
