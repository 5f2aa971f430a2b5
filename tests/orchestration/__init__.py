"""Tests of orchestration: rendezvous, local and joined pools, Ray, async refits."""
