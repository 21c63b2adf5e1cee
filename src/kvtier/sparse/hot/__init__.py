"""The hot tier: host-DRAM pools scored by the host, the hit table, and the migration it drives."""
