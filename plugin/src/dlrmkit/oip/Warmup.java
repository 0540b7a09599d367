package dlrmkit.oip;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.BufferedInputStream;
import java.io.ByteArrayOutputStream;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicReference;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.util.Connector;
import org.pytorch.serve.util.ConnectorType;
import org.pytorch.serve.util.TokenAuthorization;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.ModelVersionedRefs;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Ready means warm. A frontend JVM just started interprets its request path and compiles it
 * while the first users wait: on 2 CPUs its JIT compilers took 0.2-0.5 of a CPU over the first
 * ~9 s of load, and the slowest queries of a server just made ready (2-4x the p99 of a warm one)
 * came exactly then (results/2026-12-06-server-scenario-criteo, --ready-run). So once every
 * worker of a model has loaded it, this sends the model real requests through the frontend's
 * own inference port, every form a client uses (the seed request and columns JSON on
 * /predictions, Open Inference Protocol JSON and binary tensors on /v2) at 1 row and at large
 * sizes, from CLIENTS_PER_WORKER connections per worker, in rounds of a second, until the
 * JVM's compilers spent under SETTLED of a CPU in a round (at least MIN_ROUNDS rounds and
 * MIN_REQUESTS requests, mostly one-row ones), or the warm-up
 * budget is spent. It starts when all the model's workers (minWorkers) have loaded it, or
 * ALL_LOADED_WAIT_MS after the first did. Until then the Open Inference Protocol's readiness (model and server) answers
 * 503, so a probe keeps traffic away. The bodies are built from the archive's oip-metadata.json
 * alone: id 0 of every table, which every model scores, and DENSE for every dense value.
 *
 * <p>The budget: config.properties' dlrm_warmup_seconds (default 60; 0: no warm-up, ready as soon
 * as a worker has loaded). A warm-up that cannot reach the port (a Unix socket, https) or gets no
 * 200 logs why and ends: the model is ready then, cold, never held back for good.
 */
final class Warmup {
    static final String SECONDS_KEY = "dlrm_warmup_seconds";
    static final double DEFAULT_SECONDS = 60;
    /** Of one CPU: bench/server_scenario.py's JIT_SETTLED, what a long-running frontend spends. */
    static final double SETTLED = 0.03;

    static final int MIN_ROUNDS = 2;
    /**
     * Requests before it may stop: HotSpot compiles a method with C2 once its invocations and
     * loop back-edges pass Tier4CompileThreshold (15,000), so a method called once per request
     * is compiled for good only past that many. With fewer (3,000-6,000 in 13-21 s, Criteo on 2
     * CPUs) the compilers had settled but real traffic crossed the threshold within its first
     * second: 0.2-0.8 of a CPU compiling while the slowest queries waited, and under
     * -XX:+PrintCompilation ~130 methods compiled in the first 8 s of LoadGen traffic against
     * ~50 after 20,000 requests (by hand, one server each).
     */
    static final int MIN_REQUESTS = 20_000;
    /** Each one-row form this many times per large body: per-request paths reach MIN_REQUESTS fast. */
    static final int SMALL_PER_LARGE = 8;
    static final long ROUND_MS = 1000;
    /** Rows of the large bodies: the Server scenario's queries are 100-700 pairs. */
    static final int[] ROWS = {1, 128, 700};
    /**
     * Connections per worker: requests queue and TorchServe merges them into batches, as under
     * load (one connection per worker would only ever make batches of one request).
     */
    static final int CLIENTS_PER_WORKER = 4;
    /**
     * A dense value as long as a real one's text, so the JSON bodies are about as large as real
     * ones (how the frontend reads a body depends on its size); ids are 0, every table has one.
     */
    static final String DENSE = "0.123456789012";

    private static final Logger LOG = LoggerFactory.getLogger(Warmup.class);
    /** By model version ("dlrm/1.0"): what its warm-up did; absent: not started. */
    private static final Map<String, Result> RESULTS = new ConcurrentHashMap<>();
    /** By model version: when its first worker was seen loaded (System.nanoTime). */
    private static final Map<String, Long> FIRST_LOADED = new ConcurrentHashMap<>();
    /** A worker that never loads (a crash loop) holds the warm-up back at most this long. */
    static final long ALL_LOADED_WAIT_MS = 30_000;

    /** What one model's warm-up did (logged, and in the model's v2 ready answer). */
    static final class Result {
        final long started = System.nanoTime();
        volatile boolean done;
        volatile int requests;
        volatile int refused;
        volatile int rounds;
        volatile double seconds;
        volatile double jitShare = -1;
        volatile String note = "";

        JsonObject json() {
            JsonObject o = new JsonObject();
            o.addProperty("done", done);
            o.addProperty("requests", requests);
            o.addProperty("rounds", rounds);
            double s = done ? seconds : (System.nanoTime() - started) / 1e9; // so far, while warming
            o.addProperty("seconds", Math.round(s * 10) / 10.0);
            if (jitShare >= 0) {
                o.addProperty("jit_share", Math.round(jitShare * 1000) / 1000.0);
            }
            if (!note.isEmpty()) {
                o.addProperty("note", note);
            }
            return o;
        }
    }

    private Warmup() {}

    private static final Setting BUDGET = new Setting(SECONDS_KEY, DEFAULT_SECONDS, "seconds");

    /** dlrm_warmup_seconds, read once. */
    static double budgetSeconds() {
        return BUDGET.get();
    }

    /** The model version's warm-up has ended (or there is none to wait for). */
    static boolean warm(Model model) {
        Result r = RESULTS.get(key(model));
        return (r != null && r.done) || budgetSeconds() <= 0;
    }

    /** What the model version's warm-up did so far; null before it started. */
    static JsonObject result(Model model) {
        Result r = RESULTS.get(key(model));
        return r == null ? null : r.json();
    }

    private static String key(Model model) {
        return model.getModelName() + "/" + model.getVersion();
    }

    /**
     * A daemon thread that starts each registered model version's warm-up once all its workers
     * (at least its minWorkers, at least one) have loaded it: models loaded at start and those
     * registered later alike.
     */
    static void watch() {
        Thread t =
                new Thread(
                        () -> {
                            while (true) {
                                try {
                                    Thread.sleep(200);
                                    startDue();
                                } catch (InterruptedException e) {
                                    return;
                                } catch (RuntimeException e) {
                                    LOG.warn("warm-up watcher: {}", e.toString());
                                }
                            }
                        },
                        "oip-warmup-watch");
        t.setDaemon(true);
        t.start();
    }

    private static void startDue() {
        ModelManager manager = ModelManager.getInstance();
        if (manager == null || budgetSeconds() <= 0) {
            return;
        }
        for (Map.Entry<String, ModelVersionedRefs> m : manager.getAllModels()) {
            for (Map.Entry<String, Model> v : m.getValue().getAllVersions()) {
                Model model = v.getValue();
                int want = Math.max(1, model.getMinWorkers());
                int loaded = OpenInferenceEndpoint.readyWorkers(model);
                if (RESULTS.containsKey(key(model)) || loaded == 0) {
                    continue;
                }
                // all its workers, or what has loaded ALL_LOADED_WAIT_MS after the first did
                long first = FIRST_LOADED.computeIfAbsent(key(model), k -> System.nanoTime());
                if (loaded < want
                        && System.nanoTime() - first < ALL_LOADED_WAIT_MS * 1_000_000L) {
                    continue;
                }
                Result r = new Result();
                if (RESULTS.putIfAbsent(key(model), r) == null) {
                    Thread t = new Thread(() -> run(model, r), "oip-warmup-" + key(model));
                    t.setDaemon(true);
                    t.start();
                }
            }
        }
    }

    private static void run(Model model, Result r) {
        long t0 = r.started;
        try {
            warmUp(model, r, t0);
        } catch (IOException | RuntimeException e) {
            r.note = "stopped: " + e;
        } catch (InterruptedException e) {
            r.note = "interrupted";
            Thread.currentThread().interrupt();
        } finally {
            r.seconds = (System.nanoTime() - t0) / 1e9;
            r.done = true;
            LOG.info(
                    "{} {}: warm-up ended after {} requests in {} round(s), {} s, the JIT at {} of"
                            + " a CPU in the last round{}",
                    model.getModelName(),
                    model.getVersion(),
                    r.requests,
                    r.rounds,
                    String.format("%.1f", r.seconds),
                    r.jitShare < 0 ? "n/a" : String.format("%.3f", r.jitShare),
                    r.note.isEmpty() ? "" : " (" + r.note + ")");
        }
    }

    private static void warmUp(Model model, Result r, long t0)
            throws IOException, InterruptedException {
        InetSocketAddress address = address();
        if (address == null) {
            r.note = "the inference address is not plain http on TCP: not warmed";
            return;
        }
        List<Post> requests = requests(address, model);
        boolean timed = jitCpuSeconds() != null;
        long deadline = t0 + (long) (budgetSeconds() * 1e9);
        // TorchServe binds its ports once the models it loads at start have loaded: a moment after
        // the workers this waited for. Connect until the port answers (within the budget).
        while (true) {
            try (Socket probe = new Socket()) {
                probe.connect(address, 1_000);
                break;
            } catch (IOException e) {
                if (System.nanoTime() > deadline) {
                    r.note = "the inference port never accepted a connection: " + e;
                    return;
                }
                Thread.sleep(100);
            }
        }
        int threads = CLIENTS_PER_WORKER * Math.max(1, OpenInferenceEndpoint.readyWorkers(model));
        AtomicInteger next = new AtomicInteger();
        while (System.nanoTime() < deadline) {
            Map<String, Double> c0 = jitCpuSeconds();
            long r0 = System.nanoTime();
            long end = Math.min(deadline, r0 + ROUND_MS * 1_000_000L);
            List<Thread> senders = new ArrayList<>();
            AtomicReference<String> failure = new AtomicReference<>();
            for (int i = 0; i < threads; i++) {
                Thread s =
                        new Thread(
                                () -> {
                                    Connection c = new Connection(address);
                                    while (System.nanoTime() < end && failure.get() == null) {
                                        Post q =
                                                requests.get(
                                                        Math.floorMod(
                                                                next.getAndIncrement(),
                                                                requests.size()));
                                        String why = c.send(q);
                                        if (why != null) {
                                            failure.compareAndSet(null, why);
                                        }
                                    }
                                    c.close();
                                },
                                "oip-warmup-send");
                s.setDaemon(true);
                s.start();
                senders.add(s);
            }
            for (Thread s : senders) {
                s.join();
            }
            r.requests = next.get();
            r.rounds++;
            if (failure.get() != null) {
                r.note = failure.get();
                return;
            }
            Map<String, Double> c1 = jitCpuSeconds();
            if (!timed || c0 == null || c1 == null) {
                r.note = "no /proc/self/task to read the JIT's CPU from: warmed for the whole budget";
                continue;
            }
            double spent = 0;
            for (Map.Entry<String, Double> e : c1.entrySet()) {
                spent += e.getValue() - c0.getOrDefault(e.getKey(), 0.0);
            }
            r.jitShare = spent / ((System.nanoTime() - r0) / 1e9);
            if (r.rounds >= MIN_ROUNDS && r.requests >= MIN_REQUESTS && r.jitShare < SETTLED) {
                return;
            }
        }
        if (r.note.isEmpty()) {
            r.note = "the budget (" + SECONDS_KEY + ") ran out before the JIT settled";
        }
    }

    /**
     * CPU seconds of each of this JVM's JIT compiler threads (C1/C2), by thread id, from
     * /proc/self/task/TID/stat (as bench/common.py's jit_cpu_seconds reads them from outside): the
     * compilers' CPU, not the wall time compilations took, which grows while load starves them
     * (the CompilationMXBean's). A thread that ended between two reads is not counted. null: no
     * /proc (not Linux).
     */
    static Map<String, Double> jitCpuSeconds() {
        File[] tasks = new File("/proc/self/task").listFiles();
        if (tasks == null) {
            return null;
        }
        Map<String, Double> out = new HashMap<>();
        for (File t : tasks) {
            try {
                String comm = new String(Files.readAllBytes(new File(t, "comm").toPath()), StandardCharsets.UTF_8);
                if (!comm.startsWith("C1 CompilerThre") && !comm.startsWith("C2 CompilerThre")) {
                    continue;
                }
                String stat = new String(Files.readAllBytes(new File(t, "stat").toPath()), StandardCharsets.UTF_8);
                // after "(comm)": state is field 3, utime 14 and stime 15, in clock ticks (USER_HZ 100)
                String[] f = stat.substring(stat.lastIndexOf(')') + 2).trim().split(" ");
                out.put(t.getName(), (Long.parseLong(f[11]) + Long.parseLong(f[12])) / 100.0);
            } catch (IOException | RuntimeException e) {
                // the thread ended meanwhile
            }
        }
        return out;
    }

    /** One warm-up request: its path (for messages) and its bytes on the wire. */
    static final class Post {
        final String path;
        final byte[] wire;

        Post(String path, byte[] wire) {
            this.path = path;
            this.wire = wire;
        }
    }

    /**
     * A kept-alive HTTP/1.1 connection to the inference port, by hand on a socket: a client
     * library in this JVM (java.net.http) would have its own paths compiled meanwhile, and the
     * compilers' CPU that says when the frontend is warm would count them too.
     */
    static final class Connection {
        private final InetSocketAddress address;
        private Socket socket;
        private InputStream in;

        Connection(InetSocketAddress address) {
            this.address = address;
        }

        /** null when answered 200, else why the warm-up stops. */
        String send(Post q) {
            try {
                if (socket == null) {
                    socket = new Socket();
                    socket.connect(address, 10_000);
                    socket.setSoTimeout(60_000);
                    socket.setTcpNoDelay(true);
                    in = new BufferedInputStream(socket.getInputStream());
                }
                socket.getOutputStream().write(q.wire);
                String head = readHead();
                int status = Integer.parseInt(head.substring(9, 12));
                String lower = head.toLowerCase(Locale.ROOT);
                byte[] body = readBody(lower);
                if (lower.contains("\r\nconnection: close") || body == null) {
                    close();
                }
                if (status != 200) {
                    String text = body == null ? "" : new String(body, StandardCharsets.UTF_8);
                    return q.path
                            + " answered "
                            + status
                            + ": "
                            + text.substring(0, Math.min(200, text.length()));
                }
                return null;
            } catch (IOException | RuntimeException e) {
                close();
                return q.path + ": " + e;
            }
        }

        private String readHead() throws IOException {
            ByteArrayOutputStream head = new ByteArrayOutputStream();
            int matched = 0;
            while (matched < 4) {
                int b = in.read();
                if (b < 0) {
                    throw new IOException("the server closed the connection");
                }
                head.write(b);
                matched = b == "\r\n\r\n".charAt(matched) ? matched + 1 : (b == '\r' ? 1 : 0);
            }
            return head.toString(StandardCharsets.ISO_8859_1);
        }

        /** The body by Content-Length or chunks; null when it ends with the connection. */
        private byte[] readBody(String head) throws IOException {
            int at = head.indexOf("\r\ncontent-length:");
            if (at >= 0) {
                int end = head.indexOf("\r\n", at + 2);
                return in.readNBytes(Integer.parseInt(head.substring(at + 17, end).trim()));
            }
            if (head.contains("\r\ntransfer-encoding: chunked")) {
                ByteArrayOutputStream body = new ByteArrayOutputStream();
                while (true) {
                    String line = readLine();
                    int semi = line.indexOf(';');
                    int n = Integer.parseInt((semi < 0 ? line : line.substring(0, semi)).trim(), 16);
                    if (n == 0) {
                        while (!readLine().isEmpty()) {
                            // trailers
                        }
                        return body.toByteArray();
                    }
                    body.write(in.readNBytes(n));
                    readLine();
                }
            }
            in.readAllBytes();
            return null;
        }

        private String readLine() throws IOException {
            StringBuilder sb = new StringBuilder();
            int b;
            while ((b = in.read()) >= 0 && b != '\n') {
                if (b != '\r') {
                    sb.append((char) b);
                }
            }
            return sb.toString();
        }

        void close() {
            if (socket != null) {
                try {
                    socket.close();
                } catch (IOException e) {
                    // closing anyway
                }
            }
            socket = null;
        }
    }

    /** The inference listener's TCP address on plain http (any address: loopback), else null. */
    static InetSocketAddress address() {
        Connector c = ConfigManager.getInstance().getListener(ConnectorType.INFERENCE_CONNECTOR);
        if (c == null || c.isUds() || c.isSsl()) {
            return null;
        }
        if (!(c.getSocketAddress() instanceof InetSocketAddress)) {
            return null;
        }
        InetSocketAddress a = (InetSocketAddress) c.getSocketAddress();
        if (a.getAddress() == null || a.getAddress().isAnyLocalAddress()) {
            return new InetSocketAddress(InetAddress.getLoopbackAddress(), a.getPort());
        }
        return a;
    }

    /** Every form at every size of ROWS (at most the model's max_batch_size rows). */
    static List<Post> requests(InetSocketAddress address, Model model) throws IOException {
        File file = new File(model.getModelDir(), OpenInferenceEndpoint.METADATA_FILE);
        JsonObject desc =
                JsonParser.parseString(
                                new String(Files.readAllBytes(file.toPath()), StandardCharsets.UTF_8))
                        .getAsJsonObject();
        int most = desc.has("max_batch_size") ? desc.get("max_batch_size").getAsInt() : 0;
        int dense = 0;
        List<String> sparse = new ArrayList<>();
        for (JsonElement e : desc.getAsJsonArray("inputs")) {
            JsonObject t = e.getAsJsonObject();
            String name = t.get("name").getAsString();
            if ("dense".equals(name)) {
                JsonArray shape = t.getAsJsonArray("shape");
                dense = shape.get(shape.size() - 1).getAsInt();
            } else {
                sparse.add(name);
            }
        }
        String version = model.getVersion() == null ? "" : model.getVersion();
        String v2 =
                "/v2/models/"
                        + model.getModelName()
                        + (version.isEmpty() ? "" : "/versions/" + version)
                        + "/infer";
        String predictions =
                "/predictions/" + model.getModelName() + (version.isEmpty() ? "" : "/" + version);
        String host = address.getAddress().getHostAddress();
        host = (host.contains(":") ? "[" + host + "]" : host) + ":" + address.getPort();
        String token = inferenceToken();
        List<Post> small = new ArrayList<>();
        List<Post> large = new ArrayList<>();
        small.add(post(host, predictions, "application/json", seed(dense, sparse), token, -1));
        for (int rows : ROWS) {
            if (most > 0 && rows > most) {
                rows = most;
            }
            List<Post> to = rows == 1 ? small : large;
            to.add(post(host, predictions, "application/json", columns(rows, dense, sparse), token, -1));
            to.add(post(host, v2, "application/json", v2Json(rows, dense, sparse), token, -1));
            byte[][] binary = v2Binary(rows, dense, sparse);
            to.add(post(host, v2, "application/octet-stream", binary[1], token, binary[0].length));
        }
        List<Post> out = new ArrayList<>(); // the large ones spread among the small ones
        for (Post big : large) {
            for (int i = 0; i < SMALL_PER_LARGE; i++) {
                out.addAll(small);
            }
            out.add(big);
        }
        return out;
    }

    private static Post post(
            String host, String path, String type, byte[] body, String token, int binaryHeader)
            throws IOException {
        StringBuilder head = new StringBuilder("POST ").append(path).append(" HTTP/1.1\r\n");
        head.append("Host: ").append(host).append("\r\n");
        head.append("Content-Type: ").append(type).append("\r\n");
        head.append("Content-Length: ").append(body.length).append("\r\n");
        if (token != null) {
            head.append("Authorization: Bearer ").append(token).append("\r\n");
        }
        if (binaryHeader >= 0) {
            head.append("Inference-Header-Content-Length: ").append(binaryHeader).append("\r\n");
        }
        ByteArrayOutputStream wire = new ByteArrayOutputStream();
        wire.write(head.append("\r\n").toString().getBytes(StandardCharsets.ISO_8859_1));
        wire.write(body);
        return new Post(path, wire.toByteArray());
    }

    /** The key_file.json's inference key when token authorization is on (the server's cwd). */
    private static String inferenceToken() {
        if (!Boolean.TRUE.equals(TokenAuthorization.isEnabled())) {
            return null;
        }
        try {
            JsonObject keys =
                    JsonParser.parseString(
                                    new String(
                                            Files.readAllBytes(new File("key_file.json").toPath()),
                                            StandardCharsets.UTF_8))
                            .getAsJsonObject();
            return keys.getAsJsonObject("inference").get("key").getAsString();
        } catch (IOException | RuntimeException e) {
            LOG.warn("warm-up: token authorization is on but key_file.json is unreadable: {}", e);
            return null;
        }
    }

    // --- bodies: DENSE for every dense value, id 0 of every table ----------------------------------------------

    private static byte[] utf8(CharSequence s) {
        return s.toString().getBytes(StandardCharsets.UTF_8);
    }

    private static StringBuilder repeat(StringBuilder sb, String item, int n) {
        for (int i = 0; i < n; i++) {
            sb.append(i == 0 ? "" : ",").append(item);
        }
        return sb;
    }

    /** The README's seed request: one row, every feature one id. */
    static byte[] seed(int dense, List<String> sparse) {
        StringBuilder sb = new StringBuilder("{\"dense\":[");
        repeat(sb, DENSE, dense).append("],\"sparse\":{\"keys\":[");
        List<String> quoted = new ArrayList<>();
        for (String f : sparse) {
            quoted.add(OpenInferenceEndpoint.field("k", f).get("k").toString());
        }
        sb.append(String.join(",", quoted)).append("],\"values\":[");
        repeat(sb, "0", sparse.size()).append("],\"lengths\":[");
        return utf8(repeat(sb, "1", sparse.size()).append("]}}"));
    }

    /** {"columns": {"dense": [[...] x rows], "sparse": {f: {"values", "lengths"}}}}. */
    static byte[] columns(int rows, int dense, List<String> sparse) {
        StringBuilder row = repeat(new StringBuilder("["), DENSE, dense).append("]");
        StringBuilder sb = new StringBuilder("{\"columns\":{\"dense\":[");
        repeat(sb, row.toString(), rows).append("],\"sparse\":{");
        for (int i = 0; i < sparse.size(); i++) {
            sb.append(i == 0 ? "" : ",")
                    .append(OpenInferenceEndpoint.field("k", sparse.get(i)).get("k").toString())
                    .append(":{\"values\":[");
            repeat(sb, "0", rows).append("],\"lengths\":[");
            repeat(sb, "1", rows).append("]}");
        }
        return utf8(sb.append("}}}"));
    }

    /** Open Inference Protocol JSON: dense FP32 [rows, dense], each feature INT64 [rows]. */
    static byte[] v2Json(int rows, int dense, List<String> sparse) {
        StringBuilder sb = new StringBuilder("{\"inputs\":[{\"name\":\"dense\",\"datatype\":\"FP32\"");
        sb.append(",\"shape\":[").append(rows).append(",").append(dense).append("],\"data\":[");
        repeat(sb, DENSE, rows * dense).append("]}");
        for (String f : sparse) {
            sb.append(",{\"name\":")
                    .append(OpenInferenceEndpoint.field("k", f).get("k").toString())
                    .append(",\"datatype\":\"INT64\",\"shape\":[")
                    .append(rows)
                    .append("],\"data\":[");
            repeat(sb, "0", rows).append("]}");
        }
        return utf8(sb.append("]}"));
    }

    /** The same as binary tensors: {header, header + raw little-endian data}. */
    static byte[][] v2Binary(int rows, int dense, List<String> sparse) throws IOException {
        JsonArray inputs = new JsonArray();
        JsonObject d = OpenInferenceEndpoint.field("name", "dense");
        d.addProperty("datatype", "FP32");
        JsonArray shape = new JsonArray();
        shape.add(rows);
        shape.add(dense);
        d.add("shape", shape);
        JsonObject size = new JsonObject();
        size.addProperty("binary_data_size", rows * dense * 4);
        d.add("parameters", size);
        inputs.add(d);
        for (String f : sparse) {
            JsonObject t = OpenInferenceEndpoint.field("name", f);
            t.addProperty("datatype", "INT64");
            JsonArray s = new JsonArray();
            s.add(rows);
            t.add("shape", s);
            JsonObject p = new JsonObject();
            p.addProperty("binary_data_size", rows * 8);
            t.add("parameters", p);
            inputs.add(t);
        }
        JsonObject header = new JsonObject();
        header.add("inputs", inputs);
        byte[] head = utf8(header.toString());
        ByteArrayOutputStream body = new ByteArrayOutputStream();
        body.write(head);
        ByteBuffer data =
                ByteBuffer.allocate(rows * dense * 4 + rows * 8 * sparse.size())
                        .order(ByteOrder.LITTLE_ENDIAN);
        for (int i = 0; i < rows * dense; i++) {
            data.putFloat(Float.parseFloat(DENSE));
        }
        body.write(data.array()); // the ids: INT64 0, all-zero bytes
        return new byte[][] {head, body.toByteArray()};
    }
}
