"""Draft trees: what a tree is and how it grows (`structure`, pure jnp, which the verifiers in specjax.verify
read), how the target and the drafters run one as a block of a forward (`masks`: positions, attention masks,
the accepted path's cache move), and how big a dynamic tree should be on this device (`sizing`:
total_tokens 'auto'). Modules, not re-exports, so that a verifier importing the structure loads no model."""
