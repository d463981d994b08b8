"""spindle's benchmarks: workloads, an OpenAI load client, the no-serving limit, and the runner."""
