//! The contracts shared by every Tandem process: the `tandem.v1` protobuf services and the block-hash spec. Empty until the disaggregated-serving issue adds them.
