"""Recompute the `umt5` parity fixture's expected tensors with Wan2.2's own umT5 encoder.

    python tools/parity/make_umt5.py --official CHECKOUT/Wan2.2 \
        --like tests/fixtures/golden/umt5-a.safetensors --out /tmp/umt5-a.safetensors

Builds `T5Encoder(**config)` from `wan/modules/t5.py`, loads the fixture's weights into it, and
runs `T5EncoderModel.__call__` (which trims each output to its true length) on an object made
without its checkpoint-loading constructor, with the tokenizer replaced by the stored `ids` and
`mask`. The trimmed outputs are zero-padded back to `text_len` to stack. This fixture records no
seeds (`settings.weight_init` gives only the rule), so weights and inputs are taken from the
`--like` file and only the expected tensor is recomputed. One shim: `torch.cuda.current_device`
answers "cpu", because t5.py evaluates it as a default argument at import.
"""
from __future__ import annotations

import torch

import _common as C

FAMILIES = ("umt5",)  # the fixture families this script makes
SOURCES = ("Wan-Video/Wan2.2@42bf4cfaa384bc21833865abc2f9e6c0e67233dc",)


def main():
    args = C.parser(__doc__).parse_args()
    root = C.check_checkout(args.official, "wan/modules/t5.py")
    C.cpu_fp32()
    meta, config, settings, like = C.read_fixture(args.like)
    torch.cuda.current_device = lambda: "cpu"
    C.skip_package_inits(root, "wan")
    from wan.modules import t5

    weights, inputs = C.group(like, "weights"), C.group(like, "inputs")
    encoder = t5.T5Encoder(**config).eval()
    encoder.load_state_dict(weights)
    ids, mask = inputs["ids"].long(), inputs["mask"].long()

    wrapper = t5.T5EncoderModel.__new__(t5.T5EncoderModel)
    wrapper.model, wrapper.text_len = encoder, settings["text_len"]
    wrapper.tokenizer = lambda texts, return_mask, add_special_tokens: (ids, mask)
    with torch.no_grad():
        trimmed = wrapper(["stored ids"] * ids.shape[0], "cpu")
    context = torch.zeros(ids.shape[0], settings["text_len"], config["dim"])
    for row, out in enumerate(trimmed):
        context[row, :out.shape[0]] = out
    report = C.write_and_compare(args.out, meta, like, weights, inputs, {"context": context})
    report["inputs_from_like"] = sorted(f"inputs.{k}" for k in inputs)
    report["weights_from_like"] = True
    C.finish(report)


if __name__ == "__main__":
    main()
