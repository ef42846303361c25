"""segflow's own C kernels: the sources, their build and the trusted cache."""
