// RUN: abp-opt %s -abp-map-threads=block-size=100 -verify-diagnostics

// expected-error @below {{abp-map-threads: block-size must be a multiple of 32 in [32, 1024], got 100}}
module {
}
