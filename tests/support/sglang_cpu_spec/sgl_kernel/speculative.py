"""``reconstruct_indices_from_tree_mask`` as SGLang's own Triton form of it (the kernel its
XPU branch launches), for the generic CPU path under Triton's interpreter."""


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size,
                                       draft_token_num):
    from sglang.kernels.ops.speculative.reconstruct_tree import (
        reconstruct_indices_from_tree_mask_triton,
    )

    reconstruct_indices_from_tree_mask_triton(tree_mask, verified_seq_len, positions,
                                              retrieve_index, retrieve_next_token,
                                              retrieve_next_sibling, batch_size,
                                              draft_token_num)
