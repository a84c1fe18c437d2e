"""The benchmark (`make bench`) and the HF reference model the tests share with it."""
