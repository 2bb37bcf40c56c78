"""SSD sampling is lossless: tokens from cache hits, jit and fast misses, with and without
Saguaro reshaping, follow exactly the target's distribution (chi-square against exact
probabilities over a vocabulary of 8, tokens 1-3 and 3-5, so later rounds count)."""

import pytest
from lossless import NUM_TOKENS, SETTINGS, check, exact_joint, sample_ssd

from specfork import SamplingParams

pytestmark = pytest.mark.dist

SAMPLES = [6000, pytest.param(24000, marks=pytest.mark.slow)]  # default / the long version

CASES = {  # backup, Saguaro coefficient, sampling setting
    "jit": ("jit", None, "temperature"),
    "jit-saguaro": ("jit", 0.5, "temperature"),
    "fast": ("fast", None, "temperature"),
    "fast-saguaro-top-p": ("fast", 0.5, "top-p"),
    "jit-top-k": ("jit", None, "top-k"),
    "jit-penalties": ("jit", None, "penalties"),
    "fast-saguaro-min-p": ("fast", 0.5, "min-p"),
}


@pytest.mark.parametrize("num_samples", SAMPLES)
@pytest.mark.parametrize("case", list(CASES))
def test_ssd_output_distribution_is_the_target_distribution(draft_pair, case, num_samples):
    backup, saguaro, setting = CASES[case]
    params_kw = SETTINGS[setting]
    joint = exact_joint(draft_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    for name, (stat, dof, limit) in check(sample_ssd(draft_pair, params_kw, backup, saguaro, num_samples), joint).items():
        assert stat < limit, f"{case} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"
