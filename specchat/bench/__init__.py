"""Load benchmarks behind `specchat bench`: concurrent sessions on a real model, and synthetic GPU shapes."""
