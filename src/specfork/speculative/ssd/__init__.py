"""SSD: speculative speculative decoding (Kumar, Dao, May 2026), the drafter in its own process
pre-drafting the next speculation for the likeliest verification outcomes."""
