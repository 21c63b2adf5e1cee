"""The serving engine and server under load: `bench serve`, `bench http`, `bench vllm-tier`, and HiFC's cost model."""
