//! Validate-stage data (pure, no IO): the MIG profiles of each GPU model, with how many
//! instances fit and where they may sit, restating docs/config-facts.md §4.4 and §4.5.
//!
//! Sources there: gpu-operator's default mig-parted ConfigMap (counts, PCI ids), the NVML mock
//! GPUs mig-parted tests with, and NVIDIA's MIG user guide. Seven-slice GPUs have 7 compute and
//! 8 memory slices; every 7-slice model is assumed to use the A100's placements. A30 and
//! RTX PRO 6000 have 4 of each.

/// Where instances of a profile may start (in memory slices) and how many they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub starts: &'static [u8],
    pub size: u8,
}

/// One GPU-instance profile a model offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigProfile {
    /// The name mig-parted and NVML use, such as `1g.10gb` or `1g.10gb+me`.
    pub name: &'static str,
    /// Compute (= GPU) slices one instance takes: the `g` number.
    pub slices: u8,
    /// Most instances of this profile on one GPU.
    pub max: u8,
    pub placement: Placement,
}

/// A MIG-capable GPU model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuModel {
    /// Short name used in messages.
    pub name: &'static str,
    /// Ways to recognise the model in `nvidia.com/gpu.product`: each inner list is a set of
    /// `-`-separated words that must all appear (case-insensitive). Models are tried in table
    /// order, so more specific ones come first.
    pub product_words: &'static [&'static [&'static str]],
    /// PCI device ids (vendor 0x10DE), as mig-parted's `device-filter` names them.
    pub pci_device_ids: &'static [u16],
    pub compute_slices: u8,
    pub memory_slices: u8,
    pub profiles: &'static [MigProfile],
    /// The `all-balanced` layout of gpu-operator's default config for this model.
    pub balanced: &'static [(&'static str, u8)],
}

/// PCI vendor id of NVIDIA.
pub const NVIDIA_PCI_VENDOR: u16 = 0x10DE;

const ONE_SLICE: Placement = Placement {
    starts: &[0, 1, 2, 3, 4, 5, 6],
    size: 1,
};
const ONE_SLICE_DOUBLE_MEMORY: Placement = Placement {
    starts: &[0, 2, 4, 6],
    size: 2,
};
const TWO_SLICES: Placement = Placement {
    starts: &[0, 2, 4],
    size: 2,
};
const THREE_SLICES: Placement = Placement {
    starts: &[0, 4],
    size: 4,
};
const FOUR_SLICES: Placement = Placement {
    starts: &[0],
    size: 4,
};
const SEVEN_SLICES: Placement = Placement {
    starts: &[0],
    size: 8,
};
const ONE_OF_FOUR: Placement = Placement {
    starts: &[0, 1, 2, 3],
    size: 1,
};
const TWO_OF_FOUR: Placement = Placement {
    starts: &[0, 2],
    size: 2,
};
const FOUR_OF_FOUR: Placement = Placement {
    starts: &[0],
    size: 4,
};

/// The profile set every 7-slice model has, named by its memory sizes: 1g (×7), 1g with media
/// engines (×1), 1g with double memory (×4), 2g (×3), 3g (×2), 4g (×1), 7g (×1).
macro_rules! seven_slice_profiles {
    ($g1:literal, $g1me:literal, $g1x2:literal, $g2:literal, $g3:literal, $g4:literal, $g7:literal) => {
        &[
            profile($g1, 1, 7, ONE_SLICE),
            profile($g1me, 1, 1, ONE_SLICE),
            profile($g1x2, 1, 4, ONE_SLICE_DOUBLE_MEMORY),
            profile($g2, 2, 3, TWO_SLICES),
            profile($g3, 3, 2, THREE_SLICES),
            profile($g4, 4, 1, FOUR_SLICES),
            profile($g7, 7, 1, SEVEN_SLICES),
        ]
    };
}

const fn profile(name: &'static str, slices: u8, max: u8, placement: Placement) -> MigProfile {
    MigProfile {
        name,
        slices,
        max,
        placement,
    }
}

/// Every MIG-capable model the operator knows, most specific product match first.
pub const MODELS: &[GpuModel] = &[
    GpuModel {
        name: "A100-40GB",
        product_words: &[&["A100", "40GB"], &["A800", "40GB"]],
        pci_device_ids: &[0x20B0, 0x20B1, 0x20F1, 0x20F6],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.5gb",
            "1g.5gb+me",
            "1g.10gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb"
        ),
        balanced: &[("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)],
    },
    GpuModel {
        name: "A100-80GB",
        product_words: &[&["A100", "80GB"], &["A800", "80GB"]],
        pci_device_ids: &[0x20B2, 0x20B5, 0x20F3, 0x20F5],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb"
        ),
        balanced: &[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)],
    },
    GpuModel {
        name: "H100-94GB",
        product_words: &[&["H100", "NVL"], &["H100", "94GB"]],
        pci_device_ids: &[0x2321, 0x233A],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.12gb",
            "1g.12gb+me",
            "1g.24gb",
            "2g.24gb",
            "3g.47gb",
            "4g.47gb",
            "7g.94gb"
        ),
        balanced: &[("1g.12gb", 2), ("2g.24gb", 1), ("3g.47gb", 1)],
    },
    GpuModel {
        name: "GH200-144GB",
        product_words: &[&["GH200", "144G"], &["GH200", "144GB"]],
        pci_device_ids: &[0x2348],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.18gb",
            "1g.18gb+me",
            "1g.36gb",
            "2g.36gb",
            "3g.72gb",
            "4g.72gb",
            "7g.144gb"
        ),
        balanced: &[("1g.18gb", 2), ("2g.36gb", 1), ("3g.72gb", 1)],
    },
    GpuModel {
        name: "H100-96GB/GH200-96GB/H20",
        product_words: &[&["H100", "96GB"], &["GH200"], &["H20"], &["PG506"]],
        pci_device_ids: &[0x2342, 0x233D, 0x20B6, 0x2329],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.12gb",
            "1g.12gb+me",
            "1g.24gb",
            "2g.24gb",
            "3g.48gb",
            "4g.48gb",
            "7g.96gb"
        ),
        balanced: &[("1g.12gb", 2), ("2g.24gb", 1), ("3g.48gb", 1)],
    },
    GpuModel {
        name: "H100-80GB",
        product_words: &[&["H100"], &["H800"]],
        pci_device_ids: &[0x2330, 0x2331, 0x2322, 0x2324],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb"
        ),
        balanced: &[("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)],
    },
    GpuModel {
        name: "H200-141GB",
        product_words: &[&["H200"]],
        pci_device_ids: &[0x2335, 0x233B],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.18gb",
            "1g.18gb+me",
            "1g.35gb",
            "2g.35gb",
            "3g.71gb",
            "4g.71gb",
            "7g.141gb"
        ),
        balanced: &[("1g.18gb", 2), ("2g.35gb", 1), ("3g.71gb", 1)],
    },
    GpuModel {
        name: "B200",
        product_words: &[&["B200"]],
        pci_device_ids: &[0x2901],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.23gb",
            "1g.23gb+me",
            "1g.45gb",
            "2g.45gb",
            "3g.90gb",
            "4g.90gb",
            "7g.180gb"
        ),
        balanced: &[("1g.23gb", 2), ("2g.45gb", 1), ("3g.90gb", 1)],
    },
    GpuModel {
        name: "GB200",
        product_words: &[&["GB200"]],
        pci_device_ids: &[0x2941],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.23gb",
            "1g.23gb+me",
            "1g.47gb",
            "2g.47gb",
            "3g.93gb",
            "4g.93gb",
            "7g.186gb"
        ),
        balanced: &[("1g.23gb", 2), ("2g.47gb", 1), ("3g.93gb", 1)],
    },
    GpuModel {
        name: "B300",
        product_words: &[&["B300"]],
        pci_device_ids: &[0x3182],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.34gb",
            "1g.34gb+me",
            "1g.67gb",
            "2g.67gb",
            "3g.135gb",
            "4g.135gb",
            "7g.269gb"
        ),
        balanced: &[("1g.34gb", 2), ("2g.67gb", 1), ("3g.135gb", 1)],
    },
    GpuModel {
        name: "GB300",
        product_words: &[&["GB300"]],
        pci_device_ids: &[0x31C2],
        compute_slices: 7,
        memory_slices: 8,
        profiles: seven_slice_profiles!(
            "1g.35gb",
            "1g.35gb+me",
            "1g.70gb",
            "2g.70gb",
            "3g.139gb",
            "4g.139gb",
            "7g.278gb"
        ),
        balanced: &[("1g.35gb", 2), ("2g.70gb", 1), ("3g.139gb", 1)],
    },
    GpuModel {
        name: "A30",
        product_words: &[&["A30"]],
        pci_device_ids: &[0x20B7],
        compute_slices: 4,
        memory_slices: 4,
        profiles: &[
            profile("1g.6gb", 1, 4, ONE_OF_FOUR),
            profile("1g.6gb+me", 1, 1, ONE_OF_FOUR),
            profile("2g.12gb", 2, 2, TWO_OF_FOUR),
            profile("2g.12gb+me", 2, 1, TWO_OF_FOUR),
            profile("4g.24gb", 4, 1, FOUR_OF_FOUR),
        ],
        balanced: &[("1g.6gb", 2), ("2g.12gb", 1)],
    },
    GpuModel {
        name: "RTX-PRO-6000",
        product_words: &[&["RTX", "PRO", "6000"]],
        pci_device_ids: &[0x2BB5],
        compute_slices: 4,
        memory_slices: 4,
        profiles: &[
            profile("1g.24gb", 1, 4, ONE_OF_FOUR),
            profile("1g.24gb+gfx", 1, 4, ONE_OF_FOUR),
            profile("1g.24gb-me", 1, 4, ONE_OF_FOUR),
            profile("1g.24gb+me.all", 1, 1, ONE_OF_FOUR),
            profile("2g.48gb", 2, 2, TWO_OF_FOUR),
            profile("2g.48gb+gfx", 2, 2, TWO_OF_FOUR),
            profile("2g.48gb-me", 2, 2, TWO_OF_FOUR),
            profile("2g.48gb+me.all", 2, 1, TWO_OF_FOUR),
            profile("4g.96gb", 4, 1, FOUR_OF_FOUR),
            profile("4g.96gb+gfx", 4, 1, FOUR_OF_FOUR),
        ],
        balanced: &[("1g.24gb", 2), ("2g.48gb", 1)],
    },
];

impl GpuModel {
    pub fn profile(&self, name: &str) -> Option<&'static MigProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// `device-filter` values (`0x<device><vendor>`) that select this model.
    pub fn device_filters(&self) -> Vec<String> {
        self.pci_device_ids
            .iter()
            .map(|id| format!("0x{id:04X}{NVIDIA_PCI_VENDOR:04X}"))
            .collect()
    }
}

/// The board part of a `nvidia.com/gpu.product` value: GFD appends `-MIG-<profile>` (or
/// `-MIG-INVALID`) under the `single` strategy and `-SHARED` for shared resources. Returns the
/// board and whether a MIG suffix was present (then `gpu.count` counts MIG devices).
pub fn board_product(product: &str) -> (&str, bool) {
    let (board, mig) = match product.find("-MIG-") {
        Some(i) => (&product[..i], true),
        None => (product, false),
    };
    (board.strip_suffix("-SHARED").unwrap_or(board), mig)
}

/// The model a `nvidia.com/gpu.product` value names, if it is a MIG-capable model we know.
/// Accepts GFD's names (`NVIDIA-A100-SXM4-40GB`), old drivers' names without `NVIDIA-`, and any
/// `-MIG-...` / `-SHARED` suffix.
pub fn identify_model(product: &str) -> Option<&'static GpuModel> {
    let (board, _) = board_product(product);
    let words: Vec<String> = board
        .split(['-', ' ', '_'])
        .map(str::to_ascii_uppercase)
        .collect();
    MODELS.iter().find(|model| {
        model
            .product_words
            .iter()
            .any(|all| all.iter().all(|w| words.iter().any(|x| x == w)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_name(product: &str) -> Option<&'static str> {
        identify_model(product).map(|m| m.name)
    }

    #[test]
    fn fake_fleet_products_are_recognised() {
        assert_eq!(model_name("Tesla-T4"), None);
        assert_eq!(model_name("NVIDIA-A100-SXM4-40GB"), Some("A100-40GB"));
        assert_eq!(model_name("NVIDIA-A100-SXM4-80GB"), Some("A100-80GB"));
        assert_eq!(model_name("NVIDIA-H100-80GB-HBM3"), Some("H100-80GB"));
        assert_eq!(model_name("NVIDIA-H200"), Some("H200-141GB"));
        assert_eq!(model_name("NVIDIA-A30"), Some("A30"));
    }

    #[test]
    fn real_gfd_names_and_suffixes_are_recognised() {
        assert_eq!(model_name("A100-SXM4-40GB"), Some("A100-40GB"));
        assert_eq!(model_name("NVIDIA-A100-PCIE-40GB"), Some("A100-40GB"));
        assert_eq!(model_name("NVIDIA-A100-80GB-PCIe"), Some("A100-80GB"));
        assert_eq!(
            model_name("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            Some("A100-40GB")
        );
        assert_eq!(
            model_name("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED"),
            Some("A100-40GB")
        );
        assert_eq!(
            model_name("NVIDIA-H100-80GB-HBM3-SHARED"),
            Some("H100-80GB")
        );
        assert_eq!(model_name("NVIDIA-H100-PCIe"), Some("H100-80GB"));
        assert_eq!(model_name("NVIDIA-H100-NVL"), Some("H100-94GB"));
        assert_eq!(model_name("NVIDIA-H200-NVL"), Some("H200-141GB"));
        assert_eq!(model_name("NVIDIA-H20"), Some("H100-96GB/GH200-96GB/H20"));
        assert_eq!(
            model_name("NVIDIA-GH200-480GB"),
            Some("H100-96GB/GH200-96GB/H20")
        );
        assert_eq!(model_name("NVIDIA-GH200-144G-HBM3e"), Some("GH200-144GB"));
        assert_eq!(model_name("NVIDIA-B200"), Some("B200"));
        assert_eq!(model_name("NVIDIA-GB200"), Some("GB200"));
        assert_eq!(
            model_name("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"),
            Some("RTX-PRO-6000")
        );
        assert_eq!(model_name("NVIDIA-A30-MIG-1g.6gb"), Some("A30"));
        assert_eq!(model_name("NVIDIA-L4"), None);
        assert_eq!(model_name("NVIDIA-A10"), None);
    }

    #[test]
    fn table_restates_the_facts() {
        let a100 = identify_model("NVIDIA-A100-SXM4-40GB").unwrap();
        assert_eq!(a100.profile("1g.5gb").unwrap().max, 7);
        assert_eq!(a100.profile("1g.10gb").unwrap().max, 4);
        assert_eq!(a100.profile("2g.10gb").unwrap().max, 3);
        assert_eq!(a100.device_filters()[0], "0x20B010DE");
        // One name, different profiles per model.
        let a100_80 = identify_model("NVIDIA-A100-SXM4-80GB").unwrap();
        assert_eq!(a100_80.profile("1g.10gb").unwrap().max, 7);
        for model in MODELS {
            // A placement never runs past the GPU's memory slices, and `max` never exceeds the
            // number of starts.
            for p in model.profiles {
                assert!(
                    usize::from(p.max) <= p.placement.starts.len(),
                    "{} {}",
                    model.name,
                    p.name
                );
                for s in p.placement.starts {
                    assert!(
                        s + p.placement.size <= model.memory_slices,
                        "{} {}",
                        model.name,
                        p.name
                    );
                }
                assert!(p.name.starts_with(&format!("{}g.", p.slices)), "{}", p.name);
            }
            for (name, _) in model.balanced {
                assert!(model.profile(name).is_some(), "{} {name}", model.name);
            }
        }
    }
}
